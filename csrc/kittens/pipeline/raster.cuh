// Tile orders for persistent grids. Grouped raster: walk `group` tile-rows at a time, column by column
// inside the group, so the CTAs resident at any moment share A row-panels and B column-panels in L2.
#pragma once
#include "../core/divisor.cuh"

namespace kittens {

struct tile_xy {
  int row, col;
};

// Built on the host once a launch: the divisions of a task's place in the order are multiplies and shifts
// (kittens::divisor), not three integer divisions at every task's start. The last group may hold fewer rows.
struct grouped_raster {
  int tiles_rows = 1, group = 1;
  divisor per_group, rows, last_rows;  // group * tiles_cols; group; the last group's rows

  grouped_raster() = default;
  __host__ grouped_raster(int tiles_rows_, int tiles_cols, int group_)
      : tiles_rows(tiles_rows_), group(group_), per_group(group_ * tiles_cols), rows(group_),
        last_rows(tiles_rows_ - (tiles_rows_ - 1) / group_ * group_) {}
  __host__ __device__ __forceinline__ tile_xy operator()(int task) const {
    const int g = per_group.div(task), first_row = g * group, in_group = task - g * per_group.d;
    const divisor& here = tiles_rows - first_row < group ? last_rows : rows;
    const int col = here.div(in_group);
    return {first_row + in_group - col * here.d, col};
  }
};

}  // namespace kittens
