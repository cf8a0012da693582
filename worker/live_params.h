// The round driver's view of isthmus-worker's model (common/round_driver.h, LiveParams):
// the snapshot of a round's delta and the merge of the pulled state run on the compute
// backend, next to the trainable tensors (a GPU's memory on CUDA), so the host touches
// tensors only at the round boundary: the delta downloaded, the pulled state uploaded, each
// tensor straight from or into its host tensor (and a delta's host buffers are reused by
// the next round's once its push is done: Recycle).
//
// Memory: two buffers of the trainable tensors' size in the backend (the round's base and
// a staging buffer), i.e. 8 bytes per trainable parameter.
//
// Several ranks: every rank holds the same live weights and base. Rebase is then a
// collective: rank 0 passes the pulled state and the others null, and the state travels
// over the site's communicator (NCCL or Gloo) into each rank's staging buffer.
//
// Threads: the training loop's thread only (as the model).
#pragma once

#include <memory>
#include <vector>

#include "common/round_driver.h"
#include "ops/buffer.h"
#include "worker/comm/communicator.h"
#include "worker/model/gpt.h"

namespace isthmus::worker {

class ModelLiveParams : public LiveParams {
 public:
  // `gpt` and `comm` (null: one rank) are borrowed and must outlive this.
  // ResourceExhausted when the two buffers do not fit on the device.
  static Result<std::unique_ptr<ModelLiveParams>> Create(model::Gpt& gpt, comm::Communicator* comm);

  Status Reset() override;
  // base - live on the backend, downloaded tensor by tensor, negated on the host (exact); then
  // live := base - (base - live), which equals base + delta bit for bit.
  Result<std::vector<Tensor>> TakeDelta() override;
  // Upload (rank 0) or broadcast (every rank) of the pulled state P into staging, then
  // live := live - (base - P) (= live + (P - base) exactly) or, without progress, live := P;
  // base := P.
  Status Rebase(const std::vector<Tensor>* pulled, bool progressed) override;
  // Keeps the delta's host buffers for the next TakeDelta.
  void Recycle(std::vector<Tensor> delta) override { spare_.Keep(std::move(delta)); }

 private:
  ModelLiveParams(model::Gpt& gpt, comm::Communicator* comm) : gpt_(gpt), comm_(comm) {}
  size_t n() const { return static_cast<size_t>(gpt_.TrainableElements()); }

  model::Gpt& gpt_;
  comm::Communicator* comm_;
  ops::Buffer base_;     // the round's base (backend memory)
  ops::Buffer staging_;  // -delta, then the pulled state
  DeltaBuffers spare_;   // a recycled delta's host buffers
};

}  // namespace isthmus::worker
