0Bzero_pointsJ0v
ááH
	²î
9	Gn	Ü
bÃ	upÜœ7}®
È‹
