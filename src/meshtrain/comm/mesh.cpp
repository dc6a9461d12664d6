#include "meshtrain/comm/mesh.h"

#include <fmt/format.h>

#include "meshtrain/util/error.h"

namespace meshtrain {

MeshLayout::MeshLayout(int world_size, int tp, int pp, int cp) : cp_(cp), tp_(tp), pp_(pp) {
  MESHTRAIN_CHECK(tp >= 1 && pp >= 1 && cp >= 1,
                  "mesh: parallel.tp ({}), parallel.pp ({}) and parallel.cp ({}) must be >= 1", tp,
                  pp, cp);
  const int model = cp * tp * pp;
  MESHTRAIN_CHECK(world_size % model == 0,
                  "mesh: world size {} is not divisible by {}tp {} x pp {} = {}: run a multiple "
                  "of {} ranks",
                  world_size, cp > 1 ? fmt::format("cp {} x ", cp) : "", tp, pp, model, model);
  dp_ = world_size / model;
}

MeshCoord MeshLayout::coord(int rank) const {
  MESHTRAIN_CHECK(rank >= 0 && rank < world_size(), "mesh: rank {} outside [0, {})", rank,
                  world_size());
  return MeshCoord{.dp = (rank / (tp_ * cp_)) % dp_,
                   .tp = rank % tp_,
                   .pp = rank / (tp_ * cp_ * dp_),
                   .cp = (rank / tp_) % cp_};
}

int MeshLayout::rank(MeshCoord c) const {
  MESHTRAIN_CHECK(c.dp >= 0 && c.dp < dp_ && c.cp >= 0 && c.cp < cp_ && c.tp >= 0 && c.tp < tp_ &&
                      c.pp >= 0 && c.pp < pp_,
                  "mesh: coordinate (dp {}, cp {}, tp {}, pp {}) outside {}", c.dp, c.cp, c.tp,
                  c.pp, describe());
  return ((c.pp * dp_ + c.dp) * cp_ + c.cp) * tp_ + c.tp;
}

std::string MeshLayout::describe() const {
  if (cp_ > 1) {
    return fmt::format("dp {} x cp {} x tp {} x pp {} = {} ranks", dp_, cp_, tp_, pp_,
                       world_size());
  }
  return fmt::format("dp {} x tp {} x pp {} = {} ranks", dp_, tp_, pp_, world_size());
}

DeviceMesh::DeviceMesh(Communicator& world, int tp, int pp, int ep, int cp)
    : layout_(world.size(), tp, pp, cp), world_(world), coord_(layout_.coord(world.rank())) {
  const MeshCoord c = coord_;
  const int dp = layout_.dp(), replica = layout_.replica(c), replicas = layout_.replicas();
  // Colour: the coordinates the group shares; key: the one along the axis.
  replicas_ = world.split(c.pp * tp + c.tp, replica, cp > 1 ? "dp_cp" : "dp");
  cp_ = world.split((c.pp * dp + c.dp) * tp + c.tp, c.cp, "cp");
  tp_ = world.split(c.pp * replicas + replica, c.tp, "tp");
  pp_ = world.split(replica * tp + c.tp, c.pp, "pp");
  MESHTRAIN_CHECK(ep >= 1 && replicas % ep == 0,
                  "mesh: parallel.ep = {} must be >= 1 and divide the data-parallel size {} ({})",
                  ep, replicas, layout_.describe());
  ep_ = replicas_->split(replica / ep, replica % ep, "ep");
  edp_ = replicas_->split(replica % ep, replica / ep, "edp");
}

}  // namespace meshtrain
