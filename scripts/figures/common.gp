# SPDX-License-Identifier: Apache-2.0
# Shared by the figures: an SVG terminal, a light grid, and the footnote naming where the
# figure was measured (machine, commit and date come from the run's meta.gp).
set terminal svg size 760,480 dynamic noenhanced font "Helvetica,12" background rgb "white"
set output out
set grid lc rgb "#dddddd"
set border lc rgb "#555555"
set linetype 1 lc rgb "#1f77b4" lw 2 pt 7 ps 0.6
set linetype 2 lc rgb "#d62728" lw 2 pt 5 ps 0.6
set linetype 3 lc rgb "#2ca02c" lw 2 pt 9 ps 0.7
set linetype 4 lc rgb "#9467bd" lw 2 pt 11 ps 0.7
set linetype 5 lc rgb "#ff7f0e" lw 2 pt 13 ps 0.7
set linetype 6 lc rgb "#8c564b" lw 2 pt 7 ps 0.6
footnote = "Measured on " . machine . ", commit " . commit . ", " . measured . " (scripts/figures.sh)"
set label 99 footnote at screen 0.01, screen 0.02 left font ",9" tc rgb "#555555"
