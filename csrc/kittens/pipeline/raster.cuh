// Tile orders for persistent grids. Grouped raster: walk `group` tile-rows at a time, column by column
// inside the group, so the CTAs resident at any moment share A row-panels and B column-panels in L2.
#pragma once

namespace kittens {

struct tile_xy {
  int row, col;
};

__host__ __device__ inline tile_xy grouped_order(int task, int tiles_rows, int tiles_cols, int group) {
  const int per_group = group * tiles_cols;
  const int first_row = (task / per_group) * group;
  const int rows_here = tiles_rows - first_row < group ? tiles_rows - first_row : group;
  const int in_group = task % per_group;
  return {first_row + in_group % rows_here, in_group / rows_here};
}

}  // namespace kittens
