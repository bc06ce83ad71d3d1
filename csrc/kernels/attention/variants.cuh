// What the prefill and decode policy tables share: the tile a head dim runs on, and the flavours a policy takes.
#pragma once

namespace tk::attn {

// The tile a head dim runs on: 64, 128 or 256 columns (head dims between them: ragged_head_dim).
constexpr int tile_head_dim(int head_dim) { return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256; }

// A policy with attention sinks (its finalize takes each row's head's sink logit); nothing else changes.
template <typename Policy> constexpr Policy with_sinks(Policy p) {
  p.sinks = true;
  return p;
}
// A policy for a head dim below its tile's: the global layouts' columns become run-time sizes.
template <typename Policy> constexpr Policy with_ragged_head_dim(Policy p) {
  p.ragged_head_dim = true;
  return p;
}

}  // namespace tk::attn
