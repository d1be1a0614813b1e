import os

# Ray binds to 127.0.0.1 only (the Makefile exports this too); Ray reads it when first imported.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
