// isthmus._isthmus: the Python binding of the site client (common/site_client.h) and the
// key helpers. The Python-facing API, with its docs, is worker/python/isthmus/__init__.py;
// this file only crosses the boundary:
//   - tensors go out without copies: each delta is read in place through the buffer
//     protocol (float32, C-contiguous; anything else is refused, never silently copied);
//   - pulled tensors come back without copies: each numpy array points into the received
//     message, which a capsule keeps alive as long as any array of that pull lives;
//   - a Status that is not OK becomes isthmus.ShardError carrying .code (the Status code
//     name, e.g. "NotFound") and .message;
//   - the GIL is released while a call waits on the network, and the wait is interruptible:
//     every 100 ms (and when a signal arrives) the call takes the GIL back for a moment and
//     runs Python's signal handlers (PyErr_CheckSignals); when one raises (Ctrl-C:
//     KeyboardInterrupt) the call stops and that exception propagates;
//   - a round started with start_round runs on the round driver's thread
//     (common/round_driver.h), which then owns the site client: every other call raises
//     RuntimeError until wait_round has taken the round's outcome. That thread never takes
//     the GIL; the deltas are copied before start_round returns.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/keys.h"
#include "common/round_driver.h"
#include "common/safetensors.h"
#include "common/site_client.h"
#include "common/status.h"
#include "common/version.h"
#include "ops/codec_replica.h"
#include "ops/codec_worker.h"

namespace py = pybind11;

namespace isthmus {
namespace {

py::object& ShardErrorType() {
  static py::object type;
  return type;
}

[[noreturn]] void Raise(const Status& s) {
  py::object exc = ShardErrorType()(py::str(s.ToString()));
  exc.attr("code") = py::str(std::string(CodeName(s.code())));
  exc.attr("message") = py::str(s.message());
  PyErr_SetObject(ShardErrorType().ptr(), exc.ptr());
  throw py::error_already_set();
}

template <typename T>
T Take(Result<T> r) {
  if (!r.ok()) Raise(r.status());
  return std::move(r).value();
}

// The thread Python runs signal handlers on (threading.main_thread()).
unsigned long& MainThreadIdent() {
  static unsigned long ident = 0;
  return ident;
}

// SiteOptions::interrupted for calls made without the GIL: on the main thread, runs the
// pending Python signal handlers; true when one raised (the exception stays set for
// CallUnlocked to throw). Other threads never see signals: they do not take the GIL here.
bool PythonSignalRaised() {
  if (PyThread_get_thread_ident() != MainThreadIdent()) return false;
  py::gil_scoped_acquire gil;
  return PyErr_Occurred() != nullptr || PyErr_CheckSignals() != 0;
}

// Runs `f` (a call that waits on the network) without the GIL, then takes its result; an
// exception raised by a signal handler meanwhile (KeyboardInterrupt) wins over the result.
template <typename F>
auto CallUnlocked(F&& f) {
  std::optional<decltype(f())> r;
  {
    py::gil_scoped_release nogil;
    r.emplace(f());
  }
  if (PyErr_Occurred() != nullptr) throw py::error_already_set();
  return Take(std::move(*r));
}

// `value` as a uint64_t, or ValueError naming `what` (pybind11's own conversion error
// would print every argument, arrays included).
uint64_t NonNegative(int64_t value, const char* what, int64_t least = 0) {
  if (value < least) {
    throw py::value_error(std::string(what) + " must be >= " + std::to_string(least) + ", got " +
                          std::to_string(value));
  }
  return static_cast<uint64_t>(value);
}

py::dict RoundsDict(const RoundInfo& r) {
  py::dict d;
  d["local_round"] = r.local_round;
  d["committed_round"] = r.committed_round;
  d["max_rounds_ahead"] = r.max_rounds_ahead;
  return d;
}

py::dict StalenessDict(const Staleness& st) {
  py::dict d;
  d["too_far_ahead"] = st.too_far_ahead;
  d["shard"] = st.shard;
  d["rounds_ahead"] = st.rounds_ahead;
  d["limit"] = st.limit;
  d["reason"] = st.reason;
  return d;
}

// A float32, C-contiguous buffer read in place as the delta `name`.
struct HeldBuffer {
  py::buffer_info info;
  TensorView view;
};

HeldBuffer ViewOf(const std::string& name, const py::handle& obj) {
  if (!PyObject_CheckBuffer(obj.ptr())) {
    throw py::type_error("delta '" + name + "' is a " +
                         std::string(py::str(py::type::of(obj).attr("__name__"))) +
                         ", which has no buffer: pass a numpy array or a CPU torch tensor");
  }
  HeldBuffer h{py::reinterpret_borrow<py::buffer>(obj).request(), {}};
  const std::string& f = h.info.format;
  if (h.info.itemsize != 4 || (f != "f" && f != "<f" && f != "=f")) {
    throw py::type_error("delta '" + name + "' has element format '" + f + "' (" +
                         std::to_string(h.info.itemsize) +
                         " bytes); isthmus takes float32: convert it with .astype(numpy.float32)"
                         " or .float()");
  }
  int64_t expect = 4;
  for (py::ssize_t d = h.info.ndim - 1; d >= 0; --d) {
    if (h.info.shape[d] > 1 && h.info.strides[d] != expect) {
      throw py::value_error("delta '" + name +
                            "' is not C-contiguous: pass numpy.ascontiguousarray(x) or "
                            "x.contiguous()");
    }
    expect *= h.info.shape[d];
  }
  h.view.name = name;
  h.view.shape.assign(h.info.shape.begin(), h.info.shape.end());
  h.view.data = static_cast<const float*>(h.info.ptr);
  return h;
}

// The arrays of one shard's PullView, each pointing into it.
void AddArrays(std::shared_ptr<PullView> view, py::dict& out) {
  auto* keep = new std::shared_ptr<PullView>(view);
  py::capsule owner(keep, [](void* p) { delete static_cast<std::shared_ptr<PullView>*>(p); });
  for (const auto& t : view->tensors) {
    std::vector<py::ssize_t> shape(t.shape.begin(), t.shape.end());
    std::vector<py::ssize_t> strides(shape.size());
    py::ssize_t stride = sizeof(float);
    for (size_t d = shape.size(); d-- > 0;) {
      strides[d] = stride;
      stride *= shape[d];
    }
    out[py::str(t.name)] =
        py::array_t<float>(shape, strides, const_cast<float*>(t.data.data()), owner);
  }
}

// {name: array} -> fp32 Tensors (copied: files and hashes need owned data).
std::vector<Tensor> TensorsOf(const py::dict& tensors) {
  std::vector<Tensor> out;
  for (const auto& [k, v] : tensors) {
    if (!py::isinstance<py::str>(k)) throw py::type_error("tensor names must be str");
    HeldBuffer h = ViewOf(k.cast<std::string>(), v);
    Tensor t;
    t.name = h.view.name;
    t.shape = h.view.shape;
    t.data.assign(h.view.data, h.view.data + NumElements(t.shape));
    out.push_back(std::move(t));
  }
  return out;
}

py::dict ArraysOf(std::vector<Tensor> tensors) {
  py::dict out;
  for (auto& t : tensors) {
    std::vector<py::ssize_t> shape(t.shape.begin(), t.shape.end());
    py::array_t<float> a(shape);
    std::copy(t.data.begin(), t.data.end(), a.mutable_data());
    out[py::str(t.name)] = std::move(a);
  }
  return out;
}

const char* StageName(RoundDriver::Stage s, bool failed) {
  switch (s) {
    case RoundDriver::Stage::kIdle:
      return "idle";
    case RoundDriver::Stage::kPushing:
      return "pushing";
    case RoundDriver::Stage::kWaiting:
      return "waiting";
    case RoundDriver::Stage::kPulling:
      return "pulling";
    case RoundDriver::Stage::kDone:
      return failed ? "failed" : "done";
  }
  return "idle";
}

class PySite {
 public:
  explicit PySite(const SiteOptions& o) {
    py::gil_scoped_release nogil;
    auto c = SiteClient::Connect(o);
    if (!c.ok()) {
      py::gil_scoped_acquire gil;
      Raise(c.status());
    }
    site_ = std::move(c).value();
  }

  py::list Hello(const std::string& base_hash) {
    Idle("hello");
    auto result = CallUnlocked([&] { return site_->Hello(base_hash); });
    py::list out;
    for (const auto& h : result) {
      py::dict d = RoundsDict(h.rounds);
      d["shard_id"] = h.shard_id;
      d["server_version"] = h.server_version;
      d["job_version"] = h.job_version;
      d["base_hash"] = h.base_hash;
      d["tensor_count"] = h.tensor_count;
      d["push_part_bytes"] = h.push_part_bytes;
      out.append(d);
    }
    return out;
  }

  void SetPullByReplay(bool on) {
    Idle("set_pull_by_replay");
    site_->SetPuller(on ? std::make_unique<codec::ReplayPuller>() : nullptr);
  }

  // threads > 0: push_round and start_round encode the deltas here (FeedbackEncoder, on
  // `threads` threads), keeping each round's pipelines in `keep_in` when given; 0: fp32.
  void EncodeDeltas(int threads, const std::string& keep_in) {
    Idle("encode_deltas");
    if (threads < 0 || threads > 256) throw py::value_error("threads must be in 0..256");
    encoder_ = nullptr;
    if (threads == 0) {
      site_->SetEncoder(nullptr);
      return;
    }
    auto enc = std::make_unique<codec::FeedbackEncoder>(threads);
    if (!keep_in.empty()) {
      Status st = enc->KeepPipelinesIn(keep_in);
      if (!st.ok()) Raise(st);
    }
    encoder_ = enc.get();
    site_->SetEncoder(std::move(enc));
  }

  codec::FeedbackEncoder& Encoder(const char* call) const {
    Idle(call);
    if (!encoder_) {
      throw std::runtime_error(std::string(call) + ": this site does not encode its deltas: call " +
                               "encode_deltas(threads) first");
    }
    return *encoder_;
  }

  py::dict EncoderResiduals() const {
    std::vector<Tensor> out;
    for (const auto& [name, r] : Encoder("encoder_residuals").residuals()) {
      out.push_back({name, {static_cast<int64_t>(r.size())}, r});
    }
    return ArraysOf(std::move(out));
  }

  void SetEncoderResiduals(const py::dict& residuals) {
    codec::FeedbackEncoder& enc = Encoder("set_encoder_residuals");
    std::map<std::string, std::vector<float>> r;
    for (auto& t : TensorsOf(residuals)) r[t.name] = std::move(t.data);
    enc.SetResiduals(std::move(r));
  }

  py::dict Pull() {
    Idle("pull");
    auto result = CallUnlocked([&] { return site_->PullInPlace(); });
    py::dict out;
    for (auto& v : result) AddArrays(std::make_shared<PullView>(std::move(v)), out);
    return out;
  }

  py::list PushRound(int64_t round_arg, const py::dict& deltas, int64_t tokens_arg,
                     int64_t compute_ms_arg, int rank, int world) {
    Idle("push_round");
    const uint64_t round = NonNegative(round_arg, "round", 1);
    const uint64_t tokens = NonNegative(tokens_arg, "tokens");
    const uint64_t compute_ms = NonNegative(compute_ms_arg, "compute_ms");
    std::vector<HeldBuffer> held;
    held.reserve(deltas.size());
    for (const auto& [k, v] : deltas) {
      if (!py::isinstance<py::str>(k)) throw py::type_error("delta names must be str");
      held.push_back(ViewOf(k.cast<std::string>(), v));
    }
    std::vector<TensorView> views;
    for (const auto& h : held) views.push_back(h.view);
    auto result = CallUnlocked(
        [&] { return site_->PushRound(round, tokens, compute_ms, views, rank, world); });
    py::list out;
    for (const auto& p : result) {
      py::dict d = RoundsDict(p.rounds);
      d["shard"] = p.shard;
      d["key"] = p.key;
      d["duplicate"] = p.duplicate;
      d["tensors"] = p.tensors;
      out.append(d);
    }
    return out;
  }

  py::dict CheckStaleness() {
    Idle("check_staleness");
    auto result = CallUnlocked([&] { return site_->CheckStaleness(); });
    return StalenessDict(result);
  }

  py::dict WaitWithinStaleness(double timeout_s, double poll_s) {
    Idle("wait_within_staleness");
    if (timeout_s < 0 || poll_s <= 0) throw py::value_error("timeout must be >= 0, poll > 0");
    const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1e3));
    const auto poll =
        std::chrono::milliseconds(std::max<int64_t>(1, static_cast<int64_t>(poll_s * 1e3)));
    return StalenessDict(
        CallUnlocked([&] { return site_->WaitWithinStaleness(timeout, nullptr, poll); }));
  }

  std::map<std::string, int> Placement() const { return site_->placement(); }
  void SetPlacement(std::map<std::string, int> p) {
    Idle("set_placement");
    site_->SetPlacement(std::move(p));
  }
  size_t NumShards() const { return site_->num_shards(); }
  std::string PushKey(uint64_t round, int shard) const { return site_->PushKey(round, shard); }

  // --- The round driver: one round in the background -----------------------------------

  void StartRound(int64_t round_arg, const py::dict& deltas, int64_t tokens_arg,
                  int64_t compute_ms_arg, int rank, int world, bool pull, bool overlap,
                  double wait_timeout_s, double poll_s) {
    Idle("start_round");
    const uint64_t round = NonNegative(round_arg, "round", 1);
    const uint64_t tokens = NonNegative(tokens_arg, "tokens");
    const uint64_t compute_ms = NonNegative(compute_ms_arg, "compute_ms");
    if (world < 1 || rank < 0 || rank >= world) {
      throw py::value_error("rank must be in 0..world-1, got rank " + std::to_string(rank) +
                            " of world " + std::to_string(world));
    }
    if (wait_timeout_s < 0 || poll_s <= 0) {
      throw py::value_error("wait_timeout_s must be >= 0 and poll_s > 0");
    }
    auto delta = std::make_shared<std::vector<Tensor>>();
    for (const auto& [k, v] : deltas) {
      if (!py::isinstance<py::str>(k)) throw py::type_error("delta names must be str");
      HeldBuffer h = ViewOf(k.cast<std::string>(), v);
      delta->push_back({h.view.name, h.view.shape,
                        std::vector<float>(h.view.data, h.view.data + NumElements(h.view.shape))});
    }
    RoundDriverOptions o;
    o.overlap = overlap;
    o.rank = rank;
    o.world = world;
    o.pull = pull;
    o.wait_timeout = std::chrono::milliseconds(static_cast<int64_t>(wait_timeout_s * 1e3));
    o.poll = std::chrono::milliseconds(std::max<int64_t>(1, static_cast<int64_t>(poll_s * 1e3)));
    // The caller waits in slices and runs Python's signal handlers in between (main thread).
    o.await = [](const std::function<bool()>& done) {
      while (!done()) {
        if (PythonSignalRaised()) return Status::Unavailable("interrupted");
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      return Status::Ok();
    };
    const bool same =
        driver_ && driver_->options().overlap == o.overlap && driver_->options().rank == rank &&
        driver_->options().world == world && driver_->options().pull == pull &&
        driver_->options().wait_timeout == o.wait_timeout && driver_->options().poll == o.poll;
    if (!same) {
      driver_.reset();
      if (!rounds_) rounds_ = std::make_unique<SiteRounds>(*site_);
      driver_ = std::make_unique<RoundDriver>(*rounds_, nullptr, std::move(o));
    }
    Status st = driver_->Start({round, tokens, compute_ms, std::move(delta), nullptr});
    if (!st.ok()) Raise(st);
  }

  std::string RoundState() const {
    if (!driver_) return "idle";
    return StageName(driver_->stage(), driver_->Failed());
  }

  // Seconds it blocked until the round in flight is past its wait for the WAN.
  double AwaitRoundBound() {
    if (!driver_ || !driver_->busy()) return 0.0;
    return CallUnlocked([&] { return driver_->AwaitBound(); });
  }

  py::object WaitRound() {
    if (!driver_ || !driver_->busy()) return py::none();
    std::optional<RoundDriver::Outcome> out;
    {
      py::gil_scoped_release nogil;
      out.emplace(driver_->Wait());
    }
    if (PyErr_Occurred() != nullptr) throw py::error_already_set();
    if (!out->status.ok()) Raise(out->status);
    const RoundReport& r = out->report;
    py::dict d;
    d["round"] = r.round;
    py::list pushes;
    for (const auto& p : r.pushes) {
      py::dict e = RoundsDict(p.rounds);
      e["shard"] = p.shard;
      e["key"] = p.key;
      e["duplicate"] = p.duplicate;
      e["tensors"] = p.tensors;
      pushes.append(e);
    }
    d["pushes"] = pushes;
    d["pushed"] = r.pushed;
    d["staleness"] = StalenessDict(r.staleness);
    d["push_s"] = r.push_s;
    d["wait_s"] = r.wait_s;
    d["pull_s"] = r.pull_s;
    d["blocked_s"] = r.blocked_s;
    d["blocked_wan_s"] = r.blocked_wan_s;
    d["waited"] = r.waited;
    d["limit"] = driver_->limit();
    d["pulled"] =
        out->pulled.empty() ? py::object(py::none()) : py::object(ArraysOf(std::move(out->pulled)));
    return d;
  }

  void CancelRound() {
    if (driver_) driver_->Cancel();
  }

 private:
  // The site client belongs to the round driver's thread while a round is in flight.
  void Idle(const char* call) const {
    if (driver_ && driver_->busy()) {
      throw std::runtime_error(std::string(call) + ": round " +
                               std::to_string(driver_->inflight()->round) +
                               " is in flight (start_round): call wait_round() first");
    }
  }

  std::unique_ptr<SiteClient> site_;
  codec::FeedbackEncoder* encoder_ = nullptr;  // owned by site_ (encode_deltas)
  std::unique_ptr<SiteRounds> rounds_;
  std::unique_ptr<RoundDriver> driver_;  // after what it borrows: destroyed first
};

}  // namespace
}  // namespace isthmus

PYBIND11_MODULE(_isthmus, m) {
  using namespace isthmus;
  m.doc() = "isthmus site client (C++ core); use the isthmus package, not this module";
  m.attr("__version__") = std::string(kIsthmusVersion);
  m.attr("SCHEMA_VERSION") = kSchemaVersion;
  MainThreadIdent() =
      py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
  ShardErrorType() = py::reinterpret_steal<py::object>(
      PyErr_NewExceptionWithDoc("isthmus.ShardError",
                                "An isthmus operation failed. .code: the status code name "
                                "(e.g. 'NotFound', 'InvalidArgument'); .message: what happened.",
                                PyExc_RuntimeError, nullptr));
  m.attr("ShardError") = ShardErrorType();
  // The type must outlive the interpreter's module teardown order: keep a reference.
  ShardErrorType().inc_ref();

  m.def("generate_keypair", [] {
    auto k = Take(GenerateKeyPair());
    return py::make_tuple(k.public_key, k.secret_key);
  });
  m.def(
      "write_keypair",
      [](const std::string& prefix, bool overwrite) {
        auto k = Take(GenerateKeyPair());
        Status s = WriteKeyPairFiles(prefix, k, overwrite);
        if (!s.ok()) Raise(s);
        return k.public_key;
      },
      py::arg("prefix"), py::arg("overwrite") = false);
  m.def("load_keypair", [](const std::string& path) {
    auto k = Take(LoadKeyPairFile(path));
    return py::make_tuple(k.public_key, k.secret_key);
  });
  m.def("load_public_key", [](const std::string& path) { return Take(LoadPublicKeyFile(path)); });

  m.def("read_safetensors", [](const std::string& path) {
    auto f = Take(ReadSafetensors(path));
    return py::make_tuple(ArraysOf(std::move(f.tensors)), f.metadata);
  });
  m.def(
      "write_safetensors",
      [](const std::string& path, const py::dict& tensors,
         const std::map<std::string, std::string>& metadata) {
        Status s = WriteSafetensors(path, TensorsOf(tensors), metadata);
        if (!s.ok()) Raise(s);
      },
      py::arg("path"), py::arg("tensors"),
      py::arg("metadata") = std::map<std::string, std::string>{});
  m.def("tensors_hash",
        [](const py::dict& tensors) { return TensorsContentHash(TensorsOf(tensors)); });

  py::class_<PySite>(m, "SiteClient")
      .def(py::init([](std::string job, std::vector<std::string> servers,
                       std::vector<std::string> server_public_keys, std::string public_key,
                       std::string secret_key, bool insecure_plaintext, int timeout_ms,
                       int connect_timeout_ms, int retries, std::string client_name) {
             SiteOptions o;
             o.job = std::move(job);
             o.servers = std::move(servers);
             o.server_public_keys = std::move(server_public_keys);
             o.client_keys = KeyPair{std::move(public_key), std::move(secret_key)};
             o.insecure_plaintext = insecure_plaintext;
             o.timeout_ms = timeout_ms;
             o.connect_timeout_ms = connect_timeout_ms;
             o.retries = retries;
             o.client_name = std::move(client_name);
             o.interrupted = PythonSignalRaised;
             return std::make_unique<PySite>(o);
           }),
           py::arg("job"), py::arg("servers"), py::arg("server_public_keys"), py::arg("public_key"),
           py::arg("secret_key"), py::arg("insecure_plaintext"), py::arg("timeout_ms"),
           py::arg("connect_timeout_ms"), py::arg("retries"), py::arg("client_name"))
      .def("hello", &PySite::Hello, py::arg("base_hash"))
      .def("set_pull_by_replay", &PySite::SetPullByReplay, py::arg("on"))
      .def("encode_deltas", &PySite::EncodeDeltas, py::arg("threads"), py::arg("keep_in"))
      .def("encoder_residuals", &PySite::EncoderResiduals)
      .def("set_encoder_residuals", &PySite::SetEncoderResiduals, py::arg("residuals"))
      .def("pull", &PySite::Pull)
      .def("push_round", &PySite::PushRound, py::arg("round"), py::arg("deltas"), py::arg("tokens"),
           py::arg("compute_ms"), py::arg("rank"), py::arg("world"))
      .def("check_staleness", &PySite::CheckStaleness)
      .def("wait_within_staleness", &PySite::WaitWithinStaleness, py::arg("timeout_s"),
           py::arg("poll_s"))
      .def_property_readonly("placement", &PySite::Placement)
      .def("set_placement", &PySite::SetPlacement)
      .def_property_readonly("num_shards", &PySite::NumShards)
      .def("push_key", &PySite::PushKey)
      .def("start_round", &PySite::StartRound, py::arg("round"), py::arg("deltas"),
           py::arg("tokens"), py::arg("compute_ms"), py::arg("rank"), py::arg("world"),
           py::arg("pull"), py::arg("overlap"), py::arg("wait_timeout_s"), py::arg("poll_s"))
      .def("round_state", &PySite::RoundState)
      .def("await_round_bound", &PySite::AwaitRoundBound)
      .def("wait_round", &PySite::WaitRound)
      .def("cancel_round", &PySite::CancelRound);
}
