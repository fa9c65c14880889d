"""The kombu adapter on the protocol layer: the transport and its channels, the consuming
rounds (poller), prefetch and acks (qos), fanout streams, the lease keeper and adopted
deliveries, and the transport options."""
