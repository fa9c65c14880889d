"""The kombu adapter on the protocol layer: the transport and its channels, the consuming
rounds (poller), prefetch and acks (qos), fanout streams, the keeper (held deliveries, keep-alive
calls, acks retried), and the transport options."""
