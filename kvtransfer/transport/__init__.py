"""The channels beneath both sides: two-rank process groups opened on demand, their bound,
and reused buffers (see ``kvtransfer``)."""
