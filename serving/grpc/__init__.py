"""JetStream's gRPC API (`jetstream_proto.Orchestrator`: Decode, HealthCheck) over the orchestrator.

`jetstream.proto` is the wire contract; `jetstream_pb2*.py` are its generated stubs (checked in;
`python -m serving.grpc.generate` regenerates them). `decode` translates requests and responses,
`service` answers the two calls, `server` runs them on a grpc.aio server beside the HTTP server.
Like the HTTP layer, nothing here imports JAX, the model or the engine.
"""
