// The rules for names an operator or a peer chooses: jobs, snapshots, sites, shard ids and
// tensors. One rule each, used by the program that stores or acts on a name and by the
// ones that write or send it (isthmusctl, fleet init), so all refuse the same names with
// the same words.
#pragma once

#include <string>
#include <string_view>

namespace isthmus {

// Jobs and snapshots: 1-64 of [A-Za-z0-9._-], not starting with '.'. Such a name is safe as
// a file name and as a key prefix (no '/', no NUL).
bool IsValidName(const std::string& name);
// What the rule says, for error messages: "1-64 characters of A-Z a-z 0-9 . _ -, not
// starting with '.'".
const char* ValidNameRule();

// Sites (sync.site, the sites of sync.peers, fleet init's --sites): the rule of
// IsValidName. A site's name is a folder name in fleet init's output, a key in the round
// protocol's records and a label in logs and metrics.
bool IsValidSiteName(const std::string& name);
const char* SiteNameRule();

// Shard ids (shard.id): 1-128 of [A-Za-z0-9._-], not starting with '.' (fleet init's
// SITE-I fits: a 64-character site and a shard number). A shard id is a label in logs,
// metrics and status, and a systemd instance name.
bool IsValidShardId(const std::string& id);
const char* ShardIdRule();

// Tensor names of a new job: 1-512 bytes (the wire's limit), no NUL or other control
// character (bytes below 0x20 and 0x7f), not starting with '/', and no '/'-separated
// component that is "." or "..". Such a name can become a file name under an export
// folder without leaving it. Names of jobs created before this rule are not re-checked.
bool IsValidTensorName(std::string_view name);
const char* TensorNameRule();

// `name` as an error message quotes it: control characters and '\' as \xNN, cut after 64
// bytes with the full length said ("abc...(1048576 bytes)").
std::string PrintableName(std::string_view name);

}  // namespace isthmus
