
BscaleJØ+k<Æ4