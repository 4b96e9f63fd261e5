Bb_scaleJKã<pØ·<Òs<
K<