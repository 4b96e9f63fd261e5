By_scaleJмлL=
вё<млл=