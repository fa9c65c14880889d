"""The protocol layer: key names, script contracts, running scripts, one typed definition
per script, the script library, the kombu envelope as the scripts store it, and a pipeline
of unconfirmed publishes. It never imports kombu; producers and tools in Python use it
directly."""
