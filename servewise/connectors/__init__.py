"""What moves KV across an engine's boundary: the global KV store, the hand-off transports between
instances, and the files and checksums they share. Runners and the builder use these; nothing here
imports a runner, the builder or the cluster."""
