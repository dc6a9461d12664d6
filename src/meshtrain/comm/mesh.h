// The device mesh: world = dp x tp x pp ranks, TP fastest-varying and PP
// outermost:  global_rank = (pp_rank * dp + dp_rank) * tp + tp_rank.
// TP groups are neighbours (one node on a cluster); a DP replica is the
// tp x pp ranks sharing a dp_rank.
// Expert parallelism draws its ep groups from the dp ranks (ep divides dp):
// dp_rank = edp_rank * ep + ep_rank, so an ep group is ep neighbouring dp
// ranks (the all-to-alls stay on a node where they can) and the
// expert-data-parallel (edp) group is the dp ranks with the same ep_rank:
// those that hold the same experts.
#pragma once

#include <memory>
#include <string>

#include "meshtrain/comm/communicator.h"

namespace meshtrain {

struct MeshCoord {
  int dp = 0, tp = 0, pp = 0;
  bool operator==(const MeshCoord&) const = default;
};

// The arithmetic of the layout, no communication.
class MeshLayout {
 public:
  // dp = world / (tp * pp). Throws Error with the numbers when tp or pp is
  // below 1 or tp * pp does not divide the world size (the same on every rank).
  MeshLayout(int world_size, int tp, int pp);

  int world_size() const { return dp_ * tp_ * pp_; }
  int dp() const { return dp_; }
  int tp() const { return tp_; }
  int pp() const { return pp_; }
  MeshCoord coord(int rank) const;
  int rank(MeshCoord coord) const;
  std::string describe() const;  // "dp 2 x tp 1 x pp 1 = 2 ranks"

 private:
  int dp_ = 1, tp_ = 1, pp_ = 1;
};

// The layout bound to a world communicator, with one sub-communicator per
// axis holding this rank's group (ranks ordered by their coordinate on it).
class DeviceMesh {
 public:
  // Collective over `world` (three splits); `world` must outlive the mesh.
  // ep: the expert-parallel size; it must divide dp (Error naming parallel.ep).
  DeviceMesh(Communicator& world, int tp, int pp, int ep = 1);

  const MeshLayout& layout() const { return layout_; }
  MeshCoord coord() const { return coord_; }
  int rank() const { return world_.rank(); }
  int size() const { return world_.size(); }
  Communicator& world() { return world_; }
  Communicator& dp() { return *dp_; }  // same (tp, pp), size dp
  Communicator& tp() { return *tp_; }  // same (dp, pp), size tp
  Communicator& pp() { return *pp_; }  // same (dp, tp), size pp
  Communicator& ep() { return *ep_; }  // dp ranks [ep * (dp_rank / ep), +ep), size ep
  Communicator& edp() { return *edp_; }  // dp ranks with this ep_rank, size dp / ep

 private:
  MeshLayout layout_;
  Communicator& world_;
  MeshCoord coord_;
  std::unique_ptr<Communicator> dp_, tp_, pp_, ep_, edp_;
};

}  // namespace meshtrain
