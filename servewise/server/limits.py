"""What one HTTP request may take of a server (importable without the web stack, for the command line)."""
MAX_BODY_BYTES = 8 << 20  # a prompt of 128k tokens as a JSON list of ids is about 1 MiB
BODY_TIMEOUT_S = 30.0  # seconds to send a whole request body
RESTART_WAIT_S = 30.0  # seconds a request waits for an engine that is restarting before it is answered 503
