
BscaleJl¹Q°ô8