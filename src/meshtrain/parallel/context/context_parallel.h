// Context parallelism (parallel.cp): every sequence cut over the cp ranks of
// a replica (comm/mesh.h: cp groups are neighbours after tp), each rank
// holding two of its 2 x cp chunks (util/context_split.h).
//
// Contract:
// - The data loader gives rank r of the group its tokens of each row, with
//   each token's position (record-local in packed rows, its global index
//   otherwise), and the labels shifted on the whole sequence before the cut.
// - "ring" (Megatron-Core's p2p variant): no rank holds the whole sequence's
//   K/V. Each rank's packed K/V block travels around the group (sent to
//   rank + 1, received from rank - 1, the next block's transfer overlapping
//   the attention of the one in hand); the local queries' partial outputs
//   are merged by their log-sum-exp. Backward passes the blocks round again
//   with their dK/dV accumulators, which end at their owners after cp steps.
//   Saved per block: the local q, this rank's K/V block, the output and LSE.
// - "alltoall" (DeepSpeed-Ulysses): an all-to-all turns this rank's tokens
//   with every head into the whole sequence with 1/cp of the heads; each
//   rank runs the one-rank attention kernel on it, and a second all-to-all
//   turns the output back (the reverse in backward). The tp-local query and
//   kv head counts must divide by cp.
// - Everything but attention is token-local and runs on the rank's tokens as
//   it would on whole rows. Attention ("allgather", Llama 3's): K and V after
//   RoPE are all-gathered over the group, the local queries attend the whole
//   sequence under the global causal (and record) mask, and dK, dV are
//   reduce-scattered back to their owners in backward (ops::ContextDims;
//   model/block.cpp). Every call goes through the cp Communicator: numbered,
//   traced, under the watchdog.
// - Gradients of every parameter are partial sums over the rank's tokens:
//   they are averaged over the dp x cp replicas (DeviceMesh::replicas()), and
//   the loss is a (sum, count) pair reduced over the same group.
#pragma once

#include <string_view>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/util/context_split.h"
#include "meshtrain/util/error.h"

namespace meshtrain {

// How attention sees the other ranks' chunks (parallel.cp_comm).
enum class CpComm : uint8_t {
  allgather,  // K, V all-gathered; dK, dV reduce-scattered
  ring,       // K, V blocks passed around the group, partial outputs merged by log-sum-exp
  alltoall,   // Ulysses: heads re-sharded so each rank attends the whole sequence for some
};

// parallel.cp_comm's value; any other is an Error naming the key.
inline CpComm parse_cp_comm(std::string_view name) {
  if (name == "allgather") return CpComm::allgather;
  if (name == "ring") return CpComm::ring;
  MESHTRAIN_CHECK(name == "alltoall",
                  "config: parallel.cp_comm must be \"allgather\", \"ring\" or \"alltoall\", got "
                  "\"{}\"",
                  name);
  return CpComm::alltoall;
}

struct ContextParallel {
  Communicator* comm = nullptr;  // the cp group; nullptr means cp = 1
  CpComm method = CpComm::allgather;

  int rank() const { return comm != nullptr ? comm->rank() : 0; }
  int size() const { return comm != nullptr ? comm->size() : 1; }
  bool active() const { return size() > 1; }
  ContextSplit split() const { return ContextSplit{rank(), size()}; }
};

}  // namespace meshtrain
