"""cuda_ext package."""
