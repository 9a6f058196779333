"""The pdserve prefill service."""
