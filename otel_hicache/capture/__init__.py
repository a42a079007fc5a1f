"""What runs in the serving process: submit()/ack(), the poller, device timing, the channel."""
