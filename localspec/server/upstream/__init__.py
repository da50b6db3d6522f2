"""Team backends: localspec stays the editor's endpoint and sends the work to a shared server.

``config`` (what the daemon knows of the upstream) · ``client`` (httpx, TLS, failures in
words) · ``health`` (background checks, state) · ``identity`` (the stable slot) ·
``relay`` (llama-server kind: forward) · ``fim_text`` + ``openai_request`` +
``openai_stream`` + ``openai_kind`` (openai kind: FIM as text, stop rules on the stream,
llama-server's answers) · ``answer`` (a committed answer; upstream errors in llama-server's
shape) · ``backend`` (the upstream as the daemon holds it, routes per kind) · ``failover``
(the ASGI layer: upstream first, the local model when it cannot) · ``metrics``.
"""
