"""The party-boundary seam: roles, typed messages, alignment, aggregation and transports."""
