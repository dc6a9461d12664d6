// The model's part of the layout: its registry (a pipeline stage's own
// parameters) narrowed by the tensor-parallel split.
#include "meshtrain/model/model.h"

namespace meshtrain {

layout::ShardMap params_shard_map(const std::vector<ParamSpec>& specs, int tp_rank,
                                  size_t duplicate) {
  layout::ShardMap map;
  int64_t offset = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const ParamSpec& spec = specs[i];
    // An NF4 base weight is not state: a run rebuilds it as it started
    // (init, then train.init_from), exactly, so checkpoints leave it out.
    if (spec.nf4) {
      offset += spec.numel();
      continue;
    }
    // Replicated over tp: tp rank 0 writes it (routed experts too: their
    // split is over ep); a tied output layer on the last stage: the first
    // stage writes it.
    int replica = spec.split.split() && !spec.expert ? 0 : tp_rank;
    if (i == duplicate) replica = 1;
    // A frozen parameter (LoRA's base) has no optimizer state to save.
    map.tensors.push_back({spec.name, spec.split.global_shape,
                           spec.trainable ? layout::StateSet{} : layout::StateSet::master_only()});
    for (LocalRegion& r : split_regions(spec.split)) {
      map.pieces.push_back({map.tensors.size() - 1, std::move(r.region), offset + r.local_offset,
                            replica});
    }
    offset += spec.numel();
  }
  map.local_numel = offset;
  return map;
}

layout::ShardMap Model::shard_map() const {
  // The parameters lie back to back in registry order (params()[i].offset).
  std::vector<ParamSpec> specs;
  size_t duplicate = static_cast<size_t>(-1);
  for (size_t i = 0; i < params_.size(); ++i) {
    specs.push_back(params_[i].spec);
    if (param_is_duplicate(i)) duplicate = i;
  }
  layout::ShardMap map = params_shard_map(specs, tp_.rank(), duplicate);
  map.local_numel = num_params_;
  return map;
}

}  // namespace meshtrain
