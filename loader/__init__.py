"""loader package."""
