"""Generated protocol code for stalwart.v1 (run `make protos` after editing a .proto)."""
