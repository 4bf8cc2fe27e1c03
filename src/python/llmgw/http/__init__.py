"""The one HTTP/1.1 stack of every llmgw port — the gateway and admin API, the agent port, the sim
engine: the h11 loop with its deadlines and containment (`server`), what handlers get and answer
(`messages`), errors by blame (`errors`), request bodies (`body`), writing answers (`send`), the
limits (`limits`), files as bodies (`files`) and capped listeners (`listeners`). For the JSON
APIs on top: OpenAI's error shape (`openai`), JSON bodies (`jsonbody`), strict inputs (`params`)."""
