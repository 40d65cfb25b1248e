"""The one package the console imports from the engine: wire enums and figures, telemetry events, control ops, protocol."""
