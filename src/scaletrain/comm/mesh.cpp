#include "scaletrain/comm/mesh.h"

#include <atomic>

#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "scaletrain/comm/world.h"
#include "scaletrain/util/error.h"

namespace scaletrain::comm {

std::string MeshDims::describe() const {
  std::ostringstream s;
  s << "pp=" << pp << " x dp=" << (dp_shard > 0 ? std::to_string(dp()) : "?") << " (replicate=" << dp_replicate
    << " x shard=" << (dp_shard > 0 ? std::to_string(dp_shard) : "auto") << ")";
  if (cp != 1) s << " x cp=" << cp;
  s << " x tp=" << tp;
  return s.str();
}

MeshDims MeshDims::resolved(int world_size) const {
  MeshDims d = *this;
  if (d.pp < 1 || d.tp < 1 || d.cp < 1 || d.dp_replicate < 1 || d.dp_shard == 0 || d.dp_shard < -1)
    throw UsageError("mesh degrees must be positive: " + describe());
  const int fixed = d.pp * d.dp_replicate * d.cp * d.tp;
  if (d.dp_shard == -1) {
    if (world_size % fixed != 0)
      throw UsageError("mesh " + describe() + " does not fit world size " + std::to_string(world_size) +
                       ": pp x dp_replicate x cp x tp = " + std::to_string(fixed) + " does not divide it");
    d.dp_shard = world_size / fixed;
  }
  const int product = d.pp * d.dp() * d.cp * d.tp;
  if (product != world_size)
    throw UsageError("mesh " + d.describe() + " = " + std::to_string(product) + " ranks does not match world size " +
                     std::to_string(world_size));
  return d;
}

int Mesh::rank_of(const MeshDims& d, const MeshCoord& c) {
  return (((c.pp * d.dp_replicate + c.dp_replicate) * d.dp_shard + c.dp_shard) * d.cp + c.cp) * d.tp + c.tp;
}

MeshCoord Mesh::coord_of(const MeshDims& d, int rank) {
  MeshCoord c;
  c.tp = rank % d.tp;
  rank /= d.tp;
  c.cp = rank % d.cp;
  rank /= d.cp;
  c.dp_shard = rank % d.dp_shard;
  rank /= d.dp_shard;
  c.dp_replicate = rank % d.dp_replicate;
  c.pp = rank / d.dp_replicate;
  return c;
}

Mesh::Mesh(World& world, MeshDims dims) : dims_(dims.resolved(world.size())), rank_(world.rank()) {
  coord_ = coord_of(dims_, rank_);
  // The ranks that share every coordinate with this one except those `vary` changes.
  auto members = [&](const std::function<void(MeshCoord&, int)>& set, int extent) {
    std::vector<int> ranks;
    for (int i = 0; i < extent; ++i) {
      MeshCoord c = coord_;
      set(c, i);
      ranks.push_back(rank_of(dims_, c));
    }
    return ranks;
  };
  // Named by the mesh's instance number (every rank builds meshes in the same
  // order), its shape and the group's first member: unique within the job even
  // when one process builds several meshes, and agreed by all members.
  const std::string prefix = "mesh" + std::to_string(world.next_instance("mesh")) + "/" + dims_.describe() + "/";
  auto name = [&](const char* dim, const std::vector<int>& ranks) {
    return prefix + dim + "/" + std::to_string(ranks.front());
  };
  auto make = [&](const char* dim, std::vector<int> ranks) {
    if (static_cast<int>(ranks.size()) == world.size()) return world.group();
    std::string group_name = name(dim, ranks);  // before `ranks` is moved from
    return world.new_group(group_name, std::move(ranks));
  };
  world_ = world.group();
  tp_ = make("tp", members([](MeshCoord& c, int i) { c.tp = i; }, dims_.tp));
  pp_ = make("pp", members([](MeshCoord& c, int i) { c.pp = i; }, dims_.pp));
  dp_shard_ = make("dp_shard", members([](MeshCoord& c, int i) { c.dp_shard = i; }, dims_.dp_shard));
  dp_replicate_ = make("dp_replicate", members([](MeshCoord& c, int i) { c.dp_replicate = i; }, dims_.dp_replicate));
  const int S = dims_.dp_shard;
  dp_ = make("dp", members(
                       [S](MeshCoord& c, int i) {
                         c.dp_replicate = i / S;
                         c.dp_shard = i % S;
                       },
                       dims_.dp()));
  if (dims_.cp == 1) {  // Note [Context-parallel groups]
    cp_ = make("cp", {rank_});
    dp_cp_ = dp_;
    dp_shard_cp_ = dp_shard_;
    return;
  }
  const int C = dims_.cp;
  cp_ = make("cp", members([](MeshCoord& c, int i) { c.cp = i; }, C));
  dp_shard_cp_ = make("dp_shard_cp", members(
                                         [C](MeshCoord& c, int i) {
                                           c.dp_shard = i / C;
                                           c.cp = i % C;
                                         },
                                         dims_.dp_shard * C));
  dp_cp_ = make("dp_cp", members(
                             [S, C](MeshCoord& c, int i) {
                               c.dp_replicate = i / (S * C);
                               c.dp_shard = i / C % S;
                               c.cp = i % C;
                             },
                             dims_.dp() * C));
}

void Mesh::add_expert_parallel(World& world, int ep) {
  const std::vector<int>& dp = dp_->ranks();
  const int n = static_cast<int>(dp.size());
  if (ep < 1 || n % ep != 0)
    throw std::invalid_argument("expert parallel degree " + std::to_string(ep) + " does not divide the " +
                                std::to_string(n) + " data-parallel ranks");
  if (ep_) throw std::logic_error("Mesh: expert parallelism added twice");
  const int i = dp_->rank();
  std::vector<int> ep_ranks, edp_ranks;
  for (int j = (i / ep) * ep; j < (i / ep + 1) * ep; ++j) ep_ranks.push_back(dp[static_cast<size_t>(j)]);
  for (int j = i % ep; j < n; j += ep) edp_ranks.push_back(dp[static_cast<size_t>(j)]);
  const std::string prefix =
      "experts" + std::to_string(world.next_instance("experts")) + "/ep" + std::to_string(ep) + "/";
  auto make = [&](const std::string& dim, std::vector<int> ranks) {
    if (static_cast<int>(ranks.size()) == world.size()) return world.group();
    const std::string name = prefix + dim + "/" + std::to_string(ranks.front());
    return world.new_group(name, std::move(ranks));
  };
  ep_ = make("ep", ep_ranks);
  expert_dp_ = make("edp", edp_ranks);
}

Group& Mesh::ep() const {
  if (!ep_) throw std::logic_error("Mesh: no expert parallelism (add_expert_parallel)");
  return *ep_;
}

}  // namespace scaletrain::comm
