// The model's part of the layout: its registry (a pipeline stage's own
// parameters) narrowed by the tensor-parallel split.
#include "meshtrain/model/model.h"

namespace meshtrain {

layout::ShardMap Model::shard_map() const {
  layout::ShardMap map;
  map.local_numel = num_params_;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Parameter& p = params_[i];
    // Replicated over tp: tp rank 0 writes it; a tied output layer on the
    // last stage: the first stage writes it.
    int replica = p.spec.split.split() ? 0 : tp_.rank();
    if (param_is_duplicate(i)) replica = 1;
    map.tensors.push_back({p.spec.name, p.spec.split.global_shape});
    for (LocalRegion& r : split_regions(p.spec.split)) {
      map.pieces.push_back({map.tensors.size() - 1, std::move(r.region), p.offset + r.local_offset,
                            replica});
    }
  }
  return map;
}

}  // namespace meshtrain
