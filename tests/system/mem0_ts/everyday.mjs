// Mem0's TypeScript client (npm mem0ai, pinned in package.json) against an InferScale server:
// the everyday calls of an app, one after another, for one new user. Prints one JSON object of
// what each call returned (the Python test asserts the contracts); a call that throws ends the
// run with its name and error on stderr and exit code 1.
// Environment: INFERSCALE_URL, INFERSCALE_KEY, MEM0_USER (MEM0_TELEMETRY=false: no events leave).
import { MemoryClient } from "mem0ai";

const url = process.env.INFERSCALE_URL;
const key = process.env.INFERSCALE_KEY;
const user = process.env.MEM0_USER;
const out = {};

async function step(name, call) {
  try {
    out[name] = await call();
    return out[name];
  } catch (error) {
    process.stderr.write(`${name}: ${error?.constructor?.name}: ${error?.message}\n`);
    process.stdout.write(JSON.stringify(out) + "\n");
    process.exit(1);
  }
}

const client = new MemoryClient({ apiKey: key, host: url });
await step("ping", async () => { await client.ping(); return "ok"; });
const horse = await step("add_text", () => client.add(
  [{ role: "user", content: "My horse is called Biscuit." }],
  { user_id: user, agent_id: "tutor", metadata: { topic: "pets", year: 2019 }, infer: false }));
await step("add_messages", () => client.add(
  [{ role: "user", content: "I teach chemistry in Porto." },
   { role: "user", content: "My sister Clara lives in Montreal." }],
  { user_id: user, metadata: { topic: "life", year: 2023 }, infer: false }));
const horseId = horse.results[0].id;
await step("get", () => client.get(horseId));
await step("get_all", () => client.getAll({ filters: { user_id: user } }));
await step("get_all_page", () => client.getAll({ filters: { user_id: user }, page: 1, pageSize: 2 }));
await step("get_all_agent", () => client.getAll({ filters: { AND: [{ user_id: user }, { agent_id: "tutor" }] } }));
await step("search", () => client.search("Where does Clara live?", { filters: { user_id: user }, top_k: 2 }));
await step("update", () => client.update(horseId, { text: "My horse is called Pickles.", metadata: { topic: "pets", year: 2024 } }));
await step("history", () => client.history(horseId));
await step("users", () => client.users());
const clara = out.search.results[0].id;
await step("delete", () => client.delete(clara));
await step("after_delete", () => client.getAll({ filters: { user_id: user } }));
await step("delete_all", () => client.deleteAll({ user_id: user, agent_id: "tutor" }));
await step("after_delete_all", () => client.getAll({ filters: { user_id: user } }));
process.stdout.write(JSON.stringify(out) + "\n");
