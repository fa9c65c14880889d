"""The kombu adapter on the protocol layer: the transport, its channels and options, the
consuming rounds (poller, consuming), fanout streams, prefetch and acks (qos), the keeper."""
