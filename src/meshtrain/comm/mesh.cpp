#include "meshtrain/comm/mesh.h"

#include <fmt/format.h>

#include "meshtrain/util/error.h"

namespace meshtrain {

MeshLayout::MeshLayout(int world_size, int tp, int pp) : tp_(tp), pp_(pp) {
  MESHTRAIN_CHECK(tp >= 1 && pp >= 1, "mesh: parallel.tp ({}) and parallel.pp ({}) must be >= 1",
                  tp, pp);
  MESHTRAIN_CHECK(world_size % (tp * pp) == 0,
                  "mesh: world size {} is not divisible by tp {} x pp {} = {}: run a multiple of "
                  "{} ranks",
                  world_size, tp, pp, tp * pp, tp * pp);
  dp_ = world_size / (tp * pp);
}

MeshCoord MeshLayout::coord(int rank) const {
  MESHTRAIN_CHECK(rank >= 0 && rank < world_size(), "mesh: rank {} outside [0, {})", rank,
                  world_size());
  return MeshCoord{.dp = (rank / tp_) % dp_, .tp = rank % tp_, .pp = rank / (tp_ * dp_)};
}

int MeshLayout::rank(MeshCoord c) const {
  MESHTRAIN_CHECK(c.dp >= 0 && c.dp < dp_ && c.tp >= 0 && c.tp < tp_ && c.pp >= 0 && c.pp < pp_,
                  "mesh: coordinate (dp {}, tp {}, pp {}) outside {}", c.dp, c.tp, c.pp,
                  describe());
  return (c.pp * dp_ + c.dp) * tp_ + c.tp;
}

std::string MeshLayout::describe() const {
  return fmt::format("dp {} x tp {} x pp {} = {} ranks", dp_, tp_, pp_, world_size());
}

DeviceMesh::DeviceMesh(Communicator& world, int tp, int pp, int ep)
    : layout_(world.size(), tp, pp), world_(world), coord_(layout_.coord(world.rank())) {
  const MeshCoord c = coord_;
  const int dp = layout_.dp();
  // Colour: the coordinates the group shares; key: the one along the axis.
  dp_ = world.split(c.pp * tp + c.tp, c.dp, "dp");
  tp_ = world.split(c.pp * dp + c.dp, c.tp, "tp");
  pp_ = world.split(c.dp * tp + c.tp, c.pp, "pp");
  MESHTRAIN_CHECK(ep >= 1 && dp % ep == 0,
                  "mesh: parallel.ep = {} must be >= 1 and divide the data-parallel size {} ({})",
                  ep, dp, layout_.describe());
  ep_ = dp_->split(c.dp / ep, c.dp % ep, "ep");
  edp_ = dp_->split(c.dp % ep, c.dp / ep, "edp");
}

}  // namespace meshtrain
