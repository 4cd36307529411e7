"""An example Pagoda plugin: paged attention written from scratch over torch's SDPA."""
