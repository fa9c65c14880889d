"""The kombu adapter on the protocol layer: the transport and its channels, the
consuming rounds (poller, consuming), fanout streams, prefetch and acks (qos), the keeper."""
