#pragma once
// The rank grid and its subgroups, built once and passed explicitly.
//
// Dimensions, outermost first: pp x dp_replicate x dp_shard x cp x tp. tp is
// innermost so tensor-parallel peers sit on neighbouring ranks (one host);
// cp next, as its ring moves keys and values at every layer; pp is outermost
// because stages exchange the least data. dp = dp_replicate x dp_shard:
// plain data parallelism uses dp_shard = 1 ... any split; HYBRID sharding
// shards inside dp_shard (a node) and replicates across dp_replicate.
//
// Note [Context-parallel groups]: the cp ranks of one data-parallel
// coordinate read the same samples and hold different parts of each
// sequence (parallel/context), so for the parameters they are data-parallel
// peers: their gradients are summed and their optimizer states may be
// sharded. dp_cp() and dp_shard_cp() are the groups the engines take (dp x
// cp and dp_shard x cp, as torchtitan flattens them); dp() and the coordinate
// dp pick the samples. With cp = 1 they are the same groups.
//
//   global rank = (((pp_i * R + r_i) * S + s_i) * C + c_i) * T + t_i
#include <memory>
#include <string>
#include <vector>

#include "scaletrain/comm/group.h"

namespace scaletrain::comm {

class World;

struct MeshDims {
  int pp = 1;            // pipeline stages
  int dp_replicate = 1;  // data-parallel replicas (outer part of dp)
  int dp_shard = -1;     // data-parallel shards (inner part of dp); -1 = whatever the world leaves
  int tp = 1;            // tensor-parallel degree
  int cp = 1;            // context-parallel degree (the sequence split over ranks)

  int dp() const { return dp_replicate * dp_shard; }
  // Fills dp_shard = -1 from the world size and checks that the degrees
  // multiply to it; the error names every degree.
  MeshDims resolved(int world_size) const;
  std::string describe() const;
};

// Coordinates of one rank in the grid.
struct MeshCoord {
  int pp = 0, dp_replicate = 0, dp_shard = 0, cp = 0, tp = 0;
  int dp(const MeshDims& d) const { return dp_replicate * d.dp_shard + dp_shard; }
};

class Mesh {
 public:
  // Builds every subgroup this rank belongs to (only members create a group).
  Mesh(World& world, MeshDims dims);

  const MeshDims& dims() const { return dims_; }
  const MeshCoord& coord() const { return coord_; }
  int rank() const { return rank_; }

  Group& world() const { return *world_; }
  Group& dp() const { return *dp_; }              // dp_replicate x dp_shard
  Group& dp_shard() const { return *dp_shard_; }
  Group& dp_replicate() const { return *dp_replicate_; }
  Group& tp() const { return *tp_; }
  Group& pp() const { return *pp_; }
  Group& cp() const { return *cp_; }
  Group& dp_cp() const { return *dp_cp_; }              // Note [Context-parallel groups]
  Group& dp_shard_cp() const { return *dp_shard_cp_; }

  // Note [Expert groups]: expert parallelism of degree `ep` splits the
  // data-parallel ranks (in dp order) into consecutive ep groups, which hold
  // one copy of every expert between them, and expert-data-parallel groups
  // of the ranks at the same position in each ep group, which hold the same
  // experts: with dp = 8 and ep = 2, ep groups {0,1} {2,3} {4,5} {6,7} and
  // expert-data groups {0,2,4,6} {1,3,5,7} (DeepSpeed-MoE's layout). ep must
  // divide dp. Collective: every rank calls it once with the same degree.
  void add_expert_parallel(World& world, int ep);
  Group& ep() const;  // after add_expert_parallel
  Group& expert_dp() const { return expert_dp_ ? *expert_dp_ : *dp_; }
  int ep_size() const { return ep_ ? ep_->size() : 1; }

  // Pure grid arithmetic, usable without a world (tests, the estimator).
  static int rank_of(const MeshDims& d, const MeshCoord& c);
  static MeshCoord coord_of(const MeshDims& d, int rank);

 private:
  MeshDims dims_;
  MeshCoord coord_;
  int rank_ = 0;
  std::shared_ptr<Group> world_, dp_, dp_shard_, dp_replicate_, tp_, pp_, cp_, dp_cp_, dp_shard_cp_, ep_, expert_dp_;
};

}  // namespace scaletrain::comm
