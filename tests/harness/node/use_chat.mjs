// Drives threadline's /api/chat the way a useChat front end does: the `ai` package's DefaultChatTransport
// sends the request and parses the UI message stream, readUIMessageStream assembles the assistant message.
// Usage: node use_chat.mjs <request.json>; request = {api, chatId, messages, token?}. Prints
// {"message": <final UIMessage>, "chunks": [<chunk type>...]} on stdout.
import { readFileSync } from 'node:fs';
import { DefaultChatTransport, readUIMessageStream } from 'ai';

const request = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const transport = new DefaultChatTransport({
  api: request.api,
  headers: request.token ? { Authorization: `Bearer ${request.token}` } : undefined,
});
const stream = await transport.sendMessages({
  chatId: request.chatId,
  messages: request.messages,
  trigger: 'submit-message',
  messageId: undefined,
  abortSignal: undefined,
});
const [forMessage, forTypes] = stream.tee();
const chunks = [];
const typesDone = (async () => {
  const reader = forTypes.getReader();
  for (;;) {
    const { done, value } = await reader.read();
    if (done) return;
    chunks.push(value.type);
  }
})();
let message;
for await (const update of readUIMessageStream({
  stream: forMessage,
  onError: (error) => {
    throw error;
  },
})) {
  message = update;
}
await typesDone;
process.stdout.write(JSON.stringify({ message, chunks }) + '\n');
