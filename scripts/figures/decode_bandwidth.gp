# SPDX-License-Identifier: Apache-2.0
# Decode attention bandwidth against context, per kernel and thread count, with the memory-read
# baseline measured alternately in the same run (dashed), and their ratio below.
load "scripts/figures/common.gp"
data = tables . "/decode.dat"
n = |decode_titles|
set multiplot title "Decode attention over fp16 K/V: bandwidth against context\n(1 query token, 32 query / 8 KV heads, head_dim 128; each step reads another layer from DRAM)"
set lmargin 10
set rmargin 3
set logscale x 2
set xrange [800:42000]
set xtics ("" 1024, "" 2048, "" 4096, "" 8192, "" 16384, "" 32768)

set origin 0, 0.33
set size 1, 0.55
set tmargin 0
set bmargin 0.5
set ylabel "GB/s of K and V"
set yrange [0:*]
set key bottom right vertical maxrows 4 Left reverse samplen 2 font ",10" opaque
plot for [i=1:n] data index i-1 using 1:2 with linespoints lt i title decode_titles[i] . ": attention", \
     for [i=1:n] data index i-1 using 1:3 with lines lt i dt 2 lw 1.5 title decode_titles[i] . ": memory read"

unset label 99
set origin 0, 0.07
set size 1, 0.25
set tmargin 0.5
set bmargin 2.2
set xtics ("1k" 1024, "2k" 2048, "4k" 4096, "8k" 8192, "16k" 16384, "32k" 32768)
set xlabel "context (tokens)" offset 0, 0.5
set ylabel "attention / read"
set yrange [0:1.1<*]
set ytics 0.25
unset key
plot for [i=1:n] data index i-1 using 1:4 with linespoints lt i notitle, 1 with lines lc rgb "#999999" dt 3 notitle
unset multiplot
