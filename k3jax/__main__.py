from k3jax.cli import entry

entry()
