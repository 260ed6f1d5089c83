"""The Ray Serve application: ingress (HTTP), encoder and decoder deployments, routing, autoscaling."""
