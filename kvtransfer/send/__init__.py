"""The sending side of the data plane: ``KVSender``, each outgoing transfer's state machine,
and the lanes that move a route's messages (see ``kvtransfer``)."""
