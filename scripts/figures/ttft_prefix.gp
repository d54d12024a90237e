# SPDX-License-Identifier: Apache-2.0
# Time to first token of a request whose prefix is cached against the same request uncached,
# by the cached prefix's length, with the speedup between them and the new tokens alone below.
load "scripts/figures/common.gp"
data = tables . "/ttft.dat"
set title sprintf("Time to first token: %d new tokens on a cached prefix vs the whole request uncached\n(example engine, synthetic 8L-1024d-16h-4kv, fp32 StaticCache, every core; wall time)", ttft_suffix)
set bmargin 5
set logscale y
set logscale x 2
set xrange [180:2900]
set xtics ("256" 256, "512" 512, "1k" 1024, "2k" 2048)
set xlabel "cached prefix (tokens)"
set ylabel "TTFT (ms)"
set key top left Left reverse font ",10"
plot data using 1:2 with linespoints lt 2 title sprintf("uncached: prefix + %d tokens prefilled", ttft_suffix), \
     data using 1:3 with linespoints lt 1 title sprintf("cached: only the %d new tokens run", ttft_suffix), \
     data using 1:($5 > 0 ? $5 : NaN) with linespoints lc rgb "#888888" dt 2 lw 1.5 pt 6 title sprintf("the %d tokens alone, into an empty cache (the floor)", ttft_suffix), \
     data using 1:(sqrt($2 * $3)):(sprintf("%.1fx", $4)) with labels font ",11" tc rgb "#333333" notitle, \
     NaN with points pt -1 title "between them: the speedup, uncached / cached"
