"""The pdserve gateway service."""
