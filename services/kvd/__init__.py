"""The pdserve kvd service."""
