"""The pdserve decode service."""
