"""The one HTTP/1.1 stack of every llmgw port — the gateway and admin API, the agent port, the sim
engine: the trio loop around the codec's server role (`llmgw.h1`) with its deadlines and
containment (`server`), what handlers get and answer (`messages`), errors by blame (`errors`),
request bodies (`body`), writing answers (`send`), the limits (`limits`), files as bodies
(`files`), capped listeners (`listeners`), and the relay of a request to the control plane's
private socket (`relay`, the codec's client role). For the JSON APIs on top: OpenAI's error shape
(`openai`), JSON bodies (`jsonbody`; large ones in a worker process, `jsonworkers`), strict
inputs (`params`)."""
