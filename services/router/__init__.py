"""The pdserve router service."""
