"""A request's windows and a live turn's passes through the encoder and decoder deployments: what
the HTTP routes and the realtime sessions (deployments/http/) call, with no protocol of their own."""
