# SPDX-License-Identifier: Apache-2.0
# memory_bytes() of each policy against the tokens each sequence holds (memory_curve's JSON);
# for PagedCache, whose memory_bytes() is its fixed pool, the bytes of the blocks in use.
load "scripts/figures/common.gp"
data = tables . "/memory.dat"
n = |mem_titles|
set title "KV cache memory against tokens, by policy\n(" . mem_shape . ")"
set bmargin 6
set xlabel "tokens per sequence"
set ylabel "GiB"
set xrange [0:4096]
set xtics 512
set yrange [0:3]
set ytics 0.5
set key top left Left reverse font ",10"
set label 98 sprintf("PagedCache's memory_bytes() is its whole pool, %.2g GiB from construction on; its lines are blocks in use x memory_bytes() / num_blocks().", mem_pool_gib) at screen 0.01, screen 0.06 left font ",9" tc rgb "#555555"
plot for [i=1:n] data index i-1 using 1:2 with lines lt i lw 2 title mem_titles[i]
