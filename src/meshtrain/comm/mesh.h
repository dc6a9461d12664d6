// The device mesh: world = dp x cp x tp x pp ranks, TP fastest-varying, then
// CP, and PP outermost:
//   global_rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank.
// TP groups are neighbours (one node on a cluster), CP groups the next
// closest. A model replica is the tp x pp ranks sharing (dp_rank, cp_rank):
// context parallelism (parallel.cp) cuts each sequence over the cp ranks, so
// gradients and ZeRO shards span the dp x cp replicas (`replicas()`), while
// the data rows are split over dp only.
// Expert parallelism draws its ep groups from the replicas (ep divides
// dp x cp): replica = edp_rank * ep + ep_rank, so an ep group is ep
// neighbouring replicas (the all-to-alls stay on a node where they can) and
// the expert-data-parallel (edp) group is the replicas with the same ep_rank:
// those that hold the same experts.
#pragma once

#include <memory>
#include <string>

#include "meshtrain/comm/communicator.h"

namespace meshtrain {

struct MeshCoord {
  int dp = 0, tp = 0, pp = 0, cp = 0;
  bool operator==(const MeshCoord&) const = default;
};

// The arithmetic of the layout, no communication.
class MeshLayout {
 public:
  // dp = world / (cp * tp * pp). Throws Error with the numbers when cp, tp
  // or pp is below 1 or cp * tp * pp does not divide the world size (the same
  // on every rank).
  MeshLayout(int world_size, int tp, int pp, int cp = 1);

  int world_size() const { return dp_ * cp_ * tp_ * pp_; }
  int dp() const { return dp_; }
  int cp() const { return cp_; }
  int tp() const { return tp_; }
  int pp() const { return pp_; }
  // The model replicas gradients are averaged over: dp x cp; a coordinate's
  // index among them (dp_rank * cp + cp_rank).
  int replicas() const { return dp_ * cp_; }
  int replica(MeshCoord c) const { return c.dp * cp_ + c.cp; }
  MeshCoord coord(int rank) const;
  int rank(MeshCoord coord) const;
  std::string describe() const;  // "dp 2 x tp 1 x pp 1 = 2 ranks" (cp named when > 1)

 private:
  int dp_ = 1, cp_ = 1, tp_ = 1, pp_ = 1;
};

// The layout bound to a world communicator, with one sub-communicator per
// axis holding this rank's group (ranks ordered by their coordinate on it).
class DeviceMesh {
 public:
  // Collective over `world` (its splits); `world` must outlive the mesh.
  // ep: the expert-parallel size; it must divide dp x cp (Error naming
  // parallel.ep). cp: the context-parallel size.
  DeviceMesh(Communicator& world, int tp, int pp, int ep = 1, int cp = 1);

  const MeshLayout& layout() const { return layout_; }
  MeshCoord coord() const { return coord_; }
  int rank() const { return world_.rank(); }
  int size() const { return world_.size(); }
  Communicator& world() { return world_; }
  // The replicas: same (tp, pp), size dp x cp, ordered by replica index;
  // gradients, the loss and ZeRO shards are reduced over it.
  Communicator& replicas() { return *replicas_; }
  Communicator& cp() { return *cp_; }  // same (dp, tp, pp), size cp
  Communicator& tp() { return *tp_; }  // same (dp, cp, pp), size tp
  Communicator& pp() { return *pp_; }  // same (dp, cp, tp), size pp
  Communicator& ep() { return *ep_; }  // replicas [ep * (replica / ep), +ep), size ep
  Communicator& edp() { return *edp_; }  // replicas with this ep_rank, size dp x cp / ep

 private:
  MeshLayout layout_;
  Communicator& world_;
  MeshCoord coord_;
  std::unique_ptr<Communicator> replicas_, cp_, tp_, pp_, ep_, edp_;
};

}  // namespace meshtrain
