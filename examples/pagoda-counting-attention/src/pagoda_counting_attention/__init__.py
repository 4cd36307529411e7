"""An example Pagoda plugin: the reference attention backend, counting its calls."""
