"""The cluster layer: several engine instances and the routers that spread requests over them."""
