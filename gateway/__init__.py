"""The HTTP front door: a stateless process speaking the OpenAI API (`/v1`, for language
models) and the KServe v2 / Open Inference Protocol (`/v2`, for every model) to HTTP clients,
and the SDK (`client_sdk.client.AsyncClient`) to the broker. It keeps nothing of its own, so
several can stand behind one load balancer. `python -m gateway --broker ADDRESS --port N`."""

# Limits' defaults, here so that the CLI (gateway.__main__) and the app share them cheaply.
MAX_BODY = 64 * 2**20  # bytes of a request body: 413 beyond
MAX_HEADER = 16 * 2**10  # bytes of a request's headers (h11's own default): 431 beyond
MAX_STREAMS_PER_KEY = 16  # event streams one API key holds open at once: 429 beyond
BODY_TIMEOUT_S = 30.0  # seconds a request's body may take to arrive: 408 past it
