"""Generate TinyTales, a corpus of short children's stories, from templates.

The course needs a default data set that ships with the repository and works offline. A seeded
random.Random fills sentence templates with a cast, places and objects, so running this script
again rebuilds byte-identical files. Every story has a named hero, a problem, feelings, dialogue
and a resolution: enough structure for a small model to learn names carried through a story,
pronoun agreement (he / she / they) and the past tense.

Template language, one beat (a sentence slot) per line:
    A | B       pick one alternative
    | C         a line starting with | adds alternatives to the beat above
    ? A | B     an optional beat, kept half of the time
    /           a paragraph break (kept in about half of the stories)
    {slot}      {A} the hero with {He} {he} {him} {his} {His} {was}; {B} the friend with
                {bHe} {bhe} {bhim} {bhis}; {P} the grown-up ("Mom") with {pHe} {phe} {phim}
                {phis} and {p} ("mom", after {his}); the rest are props and words drawn freshly.
                {was} follows a pronoun only: "Alex was" but "they were".
"""

import argparse
import json
import random
from pathlib import Path

NAMES = {
    "she": "Lily Mia Emma Zoe Anna Sara Ruby Rosa Nina Ella Maya Lucy Ivy Grace Hannah Amara"
    " Olivia Sophie Clara Julia Freya Layla Nora Stella Isla Priya Wendy Molly",
    "he": "Tom Ben Max Sam Leo Jack Finn Noah Eli Omar Theo Hugo Luke Oscar Kai Ravi"
    " Henry Arthur Felix Jacob Daniel Mateo Lucas Adam Peter Yusuf George Tim",
    "they": "Alex Kit Robin Jo Charlie Sky Riley Quinn Jordan Morgan",
}
PET_NAMES = (
    "Spot Whiskers Pip Coco Bella Rex Daisy Bubbles Muffin Ziggy Pebble Fluff Bruno Sunny"
    " Toffee Pickles Ginger Peanut Marble Clover Button Waffles Pumpkin Patch Snowball Bingo"
)
PRONOUNS = {  # subject, object, possessive, past of "to be"
    "he": ("he", "him", "his", "was"),
    "she": ("she", "her", "her", "was"),
    "they": ("they", "them", "their", "were"),
}
GROWNUPS = {"Mom": "she", "Dad": "he", "Grandma": "she", "Grandpa": "he"}

# Props are drawn once per story, so the same ball is lost and found.
PROPS = {
    "kid": "little | kind | curious | happy | brave | shy | cheerful | clever | young | quiet"
    " | busy | smart | funny | gentle",
    "pet": "little | fluffy | small | friendly | playful | tiny | brown | white | gray | spotted"
    " | fuzzy | chubby | speedy | sleepy | golden | black | striped",
    "animal": "dog | cat | rabbit | bear | fox | duck | mouse | squirrel | frog | pig | lamb"
    " | goat | hen | hedgehog | tiger | lion | giraffe | penguin | zebra | monkey | pony | beaver",
    "obj": "red ball | blue kite | teddy bear | shiny stone | toy boat | yellow hat | little drum"
    " | picture book | green balloon | toy car | soft blanket | wooden train | rag doll"
    " | purple umbrella | music box | toy dinosaur | silver whistle | pink ribbon | bucket",
    "toy": "red ball | teddy bear | toy boat | little drum | toy car | wooden train | rag doll"
    " | jump rope | box of crayons | toy robot | puzzle | toy dinosaur | spinning top",
    "light": "kite | balloon | ball | hat | paper plane | scarf | ribbon | frisbee",
    "hobby": "draw pictures | sing songs | read books | build towers with blocks | dance"
    " | splash in puddles | look at the stars | dig in the sand | pick flowers | climb trees"
    " | chase butterflies | watch the clouds | play with {his} {obj} | help in the garden"
    " | paint with bright colors | feed the ducks | make sand castles | tell funny jokes"
    " | collect pretty leaves | swing on the swings | ride {his} scooter | play the piano",
    "home": "in a small house by the woods | in a little blue house | near a big green hill"
    " | in a cozy house with a red door | by the sea | on a farm | at the end of a quiet street"
    " | above a bakery | in a cottage near the mountains | next to a busy train station",
    "town": "small village | quiet town | little town by the sea | green valley | busy town"
    " | sleepy fishing village | snowy mountain town | sunny island",
    "trait": "kind | curious | brave | funny | gentle | cheerful | clever | friendly | shy"
    " | polite | helpful | patient | careful | silly",
    "game": "hide and seek | tag | catch | ball | pretend pirates | follow the leader"
    " | hopscotch | leapfrog | marbles | treasure hunt | dragons and knights",
    "skill": "ride a bike | swim | jump rope | climb the big tree | tie {his} shoes | whistle"
    " | skip stones on the pond | do a cartwheel | fly a kite | juggle three balls"
    " | play the violin | ride a pony | read a whole book",
    "creature": "bird | robin | sparrow | baby duck | bluebird | finch | pigeon | swallow",
    "guide": "owl | deer | firefly | turtle | rabbit | hedgehog | badger | raccoon",
    "guide_adj": "wise old | kind | friendly | gentle | little | helpful",
    "breakable": "vase | cup | plate | lamp | cookie jar | flower pot | teapot | mirror | bowl",
    "plant": "sunflower | rose bush | bean plant | tulip | tomato plant | daisy | pumpkin"
    " | strawberry plant | lemon tree | cherry tree",
    "cake": "cake | pie | cherry pie | berry cake | carrot cake | chocolate cake | lemon cake"
    " | pumpkin pie | banana cake",
    "food": "apples | sandwiches | cookies | grapes | cheese | bread and jam | strawberries"
    " | peaches | pancakes | oranges | watermelon | blueberries | popcorn | pizza",
    "food2": "carrots | cherries | muffins | crackers | pears | lemonade | little cakes"
    " | honey buns | biscuits | cold milk | orange juice | plums",
}
PLACES = {  # where it is: where a lost thing can hide there
    "at the park": "under the slide | behind a bench | in the tall grass | under a big tree",
    "in the garden": "under a bush | behind the flowers | next to the shed | under a big leaf",
    "at the beach": "behind a big rock | under a pile of sand | near the water | by a shell",
    "in the forest": "in a pile of leaves | behind a log | inside a hollow tree | under a pine",
    "on the farm": "in the hay | behind the barn | next to the fence | near the duck pond",
    "at the playground": "under the swings | behind the sandbox | next to the slide",
    "in the meadow": "among the flowers | behind a rock | in the tall grass",
    "in the school yard": "under a bench | next to the gate | behind the big tree",
    "at the zoo": "near the monkeys | next to the penguin pool | under a bench by the gate",
    "by the river": "under the bridge | among the reeds | on a flat rock",
    "on the hill": "behind a bush | under a rock | in the long grass | next to an old fence",
    "in the orchard": "under an apple tree | in a basket | behind a ladder",
}
FEARS = [  # (what, where it happens, how the grown-up helps, how it ends)
    (
        "the dark",
        "When it was time for bed, {P} turned off the light. The room was very dark.",
        '{P} turned on a small night light. "Look, your room is still the same," {phe} said.',
        "{A} looked around. There was the chair, the toy box and {his} {obj}. Nothing scary.",
    ),
    (
        "thunder",
        "That night, a big storm came. Boom! went the thunder.",
        '{P} held {him} close. "Thunder is just a loud noise from the clouds," {phe} said.',
        "They counted slowly after every flash, and soon the storm moved far away.",
    ),
    (
        "the big slide",
        "At the playground, there was a very tall slide.",
        '{P} said, "I will wait right at the bottom for you."',
        "{A} took a deep breath and slid down. Whoosh! It was fast and fun.",
    ),
    (
        "the sea",
        "At the beach, the waves looked big and loud.",
        '{P} held {his} hand. "We will go in slowly, one step at a time," {phe} said.',
        "The water was cool and nice. Soon {A} was splashing and laughing.",
    ),
    (
        "the big dog next door",
        "The dog next door was very big, and it barked loudly.",
        '{P} said, "Let us say hello together. His name is Bob, and he is friendly."',
        "Bob wagged his tail and licked {A}'s hand. {A} giggled.",
    ),
    (
        "the doctor",
        "That morning, it was time to visit the doctor for a checkup.",
        '{P} held {his} hand in the waiting room. "Doctor Kim is very kind," {phe} said.',
        "The doctor listened to {A}'s heart and gave {him} a shiny sticker.",
    ),
    (
        "bees",
        "In the garden, a fat bee buzzed around the flowers.",
        '{P} said, "Stay calm. The bee is busy with the flowers, not with you."',
        "The bee flew from flower to flower and then flew away. {A} even waved goodbye.",
    ),
]
FREE = {  # drawn again for every sentence, for variety inside a story
    "Day": "One day | One morning | One sunny afternoon | Early one morning | One bright day"
    " | On a warm summer day | One afternoon | After breakfast one day | One spring morning"
    " | One windy afternoon | On a cool autumn day | Last Saturday",
    "happy": "happy | glad | very happy | so happy",
    "sad": "sad | upset | very sad | unhappy",
    "scared": "scared | afraid | very scared | frightened",
    "proud": "proud | very proud | proud and happy",
    "sadly": "sadly | softly | with a sigh",
    "tall": "tall | big | very tall",
}

OPENING = """
Once upon a time, there was {desc} named {A}. | There once was {desc} called {A}.
| Once upon a time, in a {town}, there lived {desc} named {A}.
| {A} was {desc} who lived {home}. | Not long ago, {desc} named {A} lived {home}.
? {He} loved to {hobby}. | Every day, {A} liked to {hobby}. | {A} loved to {hobby} most of all.
? {A} was very {trait}. | Everyone knew that {A} was {trait}.
"""
FRIEND = """
? {A}'s best friend was {bdesc} named {B}. | {A} had a good friend, {bdesc} named {B}.
"""
ENDING = """
? That night, {A} went to bed with a big smile. | It was a very good day.
| {A} would never forget that day. | And that was the best day ever. | The end.
"""
PLOTS = {
    "lost": """
{Day}, {A} could not find {his} {obj}. | {Day}, {A} looked for {his} {obj}, but it was gone.
{He} looked under the bed and behind the door, but it was not there.
| {He} searched the whole house, but the {obj} was nowhere.
"Where is my {obj}?" {A} asked in a small voice. | "Oh no, I lost my {obj}!" {A} cried.
? {A} felt {sad}. | Tears came to {his} eyes.
/
Just then, {B} came by. | Then {B} came to play.
"Why are you so {sad}?" {B} asked. | "What is wrong?" asked {B}.
{A} told {bhim} about the lost {obj}. | "I can't find my {obj}," said {A}.
"Don't worry, I will help you look," said {B}. | "Let's look together," {B} said.
{A} thought hard. Then {he} remembered playing {at_place}.
| They thought and thought. Yesterday, {A} had played {at_place}!
They ran to the {place} and looked everywhere. | So they went to the {place} to look.
At last, {B} saw something {spot}. It was the {obj}! | There it was, {spot}!
"You found it!" {A} shouted. | {A} hugged {his} {obj} tight.
? {A} thanked {B} again and again. | They both laughed and jumped for joy.
? {A} learned that a good friend can help when things go wrong.
| From then on, {A} put {his} {obj} away after playing.
""",
    "stuck": """
{Day}, {A} took {his} {light} to the {place}. | {Day}, {A} played with {his} {light} outside.
{He} played with it for a long time and laughed and laughed. | {He} {was} having so much fun.
Then a strong wind came. | Suddenly, the wind blew hard. | But then {he} threw it too high.
The {light} flew up and got stuck in a {tall} tree. | Up went the {light}, into a {tall} tree.
{A} jumped and jumped, but {he} could not reach it. | {A} stood on {his} toes. It was too high.
"Come down, {light}!" {A} called. | "What will I do now?" {A} said {sadly}.
/
Just then, {B} walked by. | {B} saw {A} standing under the tree and came over.
"Can you help me?" asked {A}. "My {light} is stuck." | "{B}, my {light} is stuck!" said {A}.
? {B} looked up at the tree. | {B} thought for a moment.
{bHe} found a long stick and poked the {light} until it fell down.
| {bHe} shook the tree, and the {light} fell right into {A}'s arms.
| {bHe} climbed up on a big rock and pulled the {light} free.
"Thank you, {B}!" said {A}. | {A} clapped {his} hands. "You did it!"
Then they played with the {light} together until the sun went down.
| After that, {A} and {B} took turns with the {light}.
? {A} learned that two friends together can fix a big problem.
""",
    "share": """
{Day}, {A} got a new {toy}. | {Day}, {A} was playing with {his} new {toy} {at_place}.
{He} loved it more than any other toy. | It was the best {toy} in the world, {he} thought.
Then {B} came over. | Soon, {B} saw the {toy}.
"Can I play with your {toy} too?" asked {B}. | "Wow! May I try it?" {B} asked.
"No! It is mine!" said {A}, and {he} held it close.
| {A} shook {his} head. "No, you will break it," {he} said.
{B} looked {sad} and walked away. | {B}'s face fell, and {bhe} sat down all alone.
/
{A} played alone, but it was not much fun. | Soon {A} had a funny feeling inside.
? {He} did not feel {happy} at all. | {He} looked at {B}, sitting all alone.
{A} walked over to {B}. | After a while, {A} went to find {B}.
"I am sorry," {A} said. "Do you want to play with my {toy}?" | "Here," said {A}. "Let's share."
{B} smiled a big smile. | {B}'s eyes lit up. "Thank you!" {bhe} said.
They played with the {toy} together all afternoon. | They took turns and laughed a lot.
? {A} learned that sharing makes playing more fun.
| From that day on, {A} always shared {his} toys.
""",
    "fear": """
{A} was afraid of {fear}. | There was one thing {A} did not like at all: {fear}.
{fear_start}
{He} felt {scared}, and {his} legs began to shake. | {A}'s heart beat fast.
"I am scared," {A} whispered. | "{P}, I don't want to!" cried {A}.
/
"It is okay to be scared," said {P}. "Being brave means you try anyway."
| {P} knelt down next to {A}. "I am right here," {phe} said.
{fear_help}
{fear_end}
"I did it!" {A} said. "It is not so scary after all!" | {A} smiled. {He} felt brave now.
? {P} gave {him} a big hug. | {P} smiled. "I knew you could do it," {phe} said.
? {A} learned that being brave does not mean you are never scared.
""",
    "lost_way": """
{Day}, {A} went for a walk in the forest. | {Day}, {A} followed a butterfly into the forest.
{He} saw tall trees, pretty flowers and a little stream. | The birds were singing in the trees.
{He} walked and walked, farther than ever before. | {A} did not look where {he} {was} going.
Soon the sun began to go down. | After a while, {A} stopped and looked around.
Nothing looked the same. {A} was lost! | {A} did not know the way home.
"Hello? Is anyone there?" {A} called. | "{P}! Where are you?" {A} shouted.
{He} sat down on a log and felt {scared}. | {A} began to cry.
/
Then {he} saw a {guide_adj} {guide}. | Just then, a {guide_adj} {guide} came out of the trees.
"Why are you crying, little one?" asked the {guide}. | "What is wrong?" asked the {guide}.
"I am lost," said {A}. "I want to go home."
"I know the way," said the {guide}. "Follow me." | "Come with me," said the {guide}.
The {guide} led {A} past the stream and over the hill. | They walked together through the trees.
Soon {A} saw {his} house. {P} was waiting at the door. | At last, {A} could see {his} home.
{P} gave {him} a big hug. | {A} ran into {his} {p}'s arms.
"Thank you, {guide}!" {A} called. | {A} turned to thank the {guide}, but it was gone.
? From then on, {A} always stayed on the path. | {A} learned to stay close to home.
""",
    "hurt": """
{Day}, {A} found a little {creature} {spot}. | {Day}, {A} heard a small sound {at_place}.
It was a little {creature}, and its wing was hurt. | The poor {creature} could not fly.
"Oh, poor little {creature}," {A} said softly. | "Don't be {scared}," {A} whispered.
{A} picked it up very gently and carried it home. | {He} held the {creature} gently in {his} hands.
{His} {p} helped {him} make a soft bed in a box. | {P} found a box and a soft cloth.
/
Every day, {A} gave the {creature} water and seeds. | {A} took care of the {creature} every day.
{He} named it {pet}. | {A} called the little {creature} {pet}.
Day by day, {pet} got stronger. | Soon {pet} could hop and flap its wings.
One morning, {pet} flew up high into the sky! | Then one day, {pet} flew out of the window.
{A} felt {happy} and a little sad at the same time. | "Goodbye, {pet}!" {A} called.
? The next spring, {pet} came back and sang outside {A}'s window.
? {A} learned that being kind to animals is important.
""",
    "honest": """
{Day}, {A} was playing ball in the house. | {Day}, {A} was running around the kitchen.
{His} {p} always said, "No wild games in the house." But {A} forgot.
Crash! {A} bumped into {P}'s {breakable}, and it broke into pieces.
| {A} bumped the table, and {P}'s {breakable} fell down. It broke!
{A} felt {scared}. | {A}'s tummy felt funny.
"What if I get in trouble?" {A} thought. | {He} thought about hiding the pieces.
/
When {P} came in, {phe} saw the pieces. | Soon {P} came into the room.
"What happened here?" asked {P}. | "Oh dear, what happened?" asked {P}.
{A} wanted to say that the cat did it. But that was not true. | {A} took a deep breath.
"I broke it, {P}," said {A}. "I am sorry." | "It was me," {A} said. "I am sorry."
{P} gave {A} a hug. | {P} knelt down and took {A}'s hand.
"Thank you for telling me the truth," {phe} said. | "I am proud of you for being honest."
Together they picked up the pieces and glued the {breakable} back together.
| Then they cleaned up together.
? {A} learned that telling the truth is the right thing to do.
""",
    "new_friend": """
It was {A}'s first day at a new school. | {A} and {his} family had just moved to a new town.
{He} did not know anyone. | Everything was new, and {A} felt shy.
At playtime, {A} sat all alone. | {He} watched the other kids play.
? {He} felt lonely and {sad}. | {A} wished {he} had a friend.
/
Then {B} walked up to {him}. | Then someone sat down next to {A}. It was {B}.
"Hi! I am {B}," {bhe} said. "Do you want to play?" | "Hello," said {B}. "What is your name?"
"I am {A}," {A} said quietly. | {A} smiled a little. "Yes, please," {he} said.
{B} showed {A} how to play {game}. | They played {game} until they were out of breath.
{A} laughed for the first time all day. | {A} felt {happy} inside.
? From then on, {A} and {B} played together every day. | Soon they were best friends.
? {A} learned that one kind word can make a new friend.
""",
    "try_again": """
{A} wanted to learn to {skill}. | More than anything, {A} wanted to {skill}.
{Day}, {he} tried for the first time. | {Day}, {A} decided to try.
But {he} fell down. | It was much harder than it looked.
"I will never learn!" said {A}. | {A} wanted to give up.
{His} {p} sat down next to {him}. | {P} came over and gave {him} a hug.
"Everyone finds it hard at first," said {P}. "Try again, a little at a time."
/
So {A} tried again. And again. And again. | The next day, {A} tried again.
Each day {he} got a little better. | Slowly, {he} got better and better.
Then one day, {he} did it! {A} could {skill}! | At last, {A} could {skill}!
"Look at me!" {A} shouted. | "I did it!" {A} cried.
{His} {p} clapped and cheered. | {P} was very proud.
? {A} learned that if you keep trying, you can do hard things.
""",
    "rain": """
{Day}, {A} and {B} planned a picnic {at_place}. | {A} and {B} wanted to have a picnic.
They packed {food}, {food2} and a big blanket. | They made {food} and {food2}.
But just as they got there, dark clouds came. | Then the sky turned gray.
Drip, drop, the rain began to fall. | Soon it started to rain.
"Oh no! Our picnic!" said {B}. | "Now we can't have our picnic," said {A}.
They ran home, all wet. | They hurried home in the rain.
/
{A} felt {sad}. | {A} sat by the window and watched the rain.
Then {A} had an idea. | Then {B} had an idea.
"Let's have a picnic inside!" | "We can have our picnic on the floor!"
They put the blanket on the floor and ate {food}. | They sat on the blanket and ate.
They told stories and laughed. | They played games and sang songs.
? When the rain stopped, a big rainbow was in the sky. | Soon the sun came out again.
? {A} learned that a bad day can still turn into a good day.
""",
    "bake": """
It was {B}'s birthday, and {A} wanted to make something special.
{A} and {his} {p} decided to bake a {cake}. | {P} helped {A} bake a {cake}.
They mixed flour, eggs, milk and sugar in a big bowl. | {A} stirred and stirred.
{A} stirred so fast that flour flew everywhere! | Soon {A} had flour on {his} nose.
? {P} laughed and laughed. | "Oops!" said {A}.
/
When the {cake} came out of the oven, it was a little flat. | The {cake} did not look perfect.
"It does not look very nice," said {A} {sadly}.
"It is made with love," said {P}. "That is what matters."
{A} brought the {cake} to {B}. | {A} gave the {cake} to {B}.
{B} took a big bite. "This is the best {cake} ever!" {bhe} said.
{A} felt {proud}. | {A} smiled from ear to ear.
? {A} learned that a gift made with love is the best kind of gift.
""",
    "race": """
{Day}, there was a big race at school. | {Day}, {A} and {B} ran a race in the park.
{A} and {B} both wanted to win. | {A} really wanted to win.
"Ready, set, go!" said {P}. | On "go!", everyone ran.
{A} ran as fast as {he} could. | {A} was fast, and soon {he} {was} in front.
But then {B} tripped and fell down. | Then {A} heard a cry. {B} had fallen down.
{A} could keep running and win. But {B} was hurt. | {A} stopped.
/
{A} ran back to {B}. | {A} turned around and ran back.
"Are you okay?" {A} asked. | "Let me help you," said {A}.
{A} helped {B} up, and they walked to the finish together. | They crossed the line together.
They did not win the race, but everyone clapped. | Everyone cheered for them.
? {A} learned that helping a friend is better than winning.
""",
    "snow": """
{Day}, {A} looked out of the window. Everything was white with snow!
| When {A} woke up, the whole world was covered in snow.
{A} put on {his} coat, {his} boots and {his} warm mittens. | {A} ran outside in {his} boots.
{He} rolled a small snowball into a big one. | {He} made a big ball of snow, then a smaller one.
{B} came to help, and together they built a snowman.
| Soon {B} came too, and they made a snowman together.
They gave it a carrot nose, two buttons for eyes and an old hat.
"He is the best snowman ever!" said {B}. | "Let's call him Mister Frost," said {A}.
/
But the next day, the sun came out, and it was warm.
When {A} ran outside, the snowman was gone. There was only a puddle, a carrot and the hat.
| The snowman had melted into a puddle. Only the carrot and the hat were left.
{A} felt {sad}. | "Where did our snowman go?" {A} asked {sadly}.
{P} put an arm around {him}. "Snow melts in the sun," {phe} said. "It will come back."
{A} kept the carrot and the hat in a box. | {A} put the hat on the shelf to keep it safe.
? When winter came again, {A} and {B} built an even bigger snowman.
? {A} learned that even when good things end, new ones will come.
""",
    "garden": """
{Day}, {P} gave {A} a tiny seed. | {Day}, {A} found a tiny seed.
"If you take care of it, it will grow into a {plant}," said {P}.
{A} planted the seed in a pot and gave it water. | {A} put the seed in the ground.
The next morning, {he} ran to look. Nothing! | But nothing happened.
"Why is it not growing?" {A} asked. | {A} felt {sad}.
"Plants need time," said {P}. "Be patient."
/
So {A} waited. Every day {he} watered it. | {A} gave the seed water and sun every day.
One day, {he} saw a tiny green leaf! | Then one morning, there was a little green sprout.
Weeks later, there was a big {plant}. | It grew and grew into a big {plant}.
{A} felt {proud}. | {A} showed it to everyone.
? {A} learned that good things take time.
""",
}


def pick(rng, alternatives):
    return rng.choice([a.strip() for a in alternatives.split("|")])


def parse(template):
    """Template text -> list of beats; a beat is (optional, [alternatives]) or "/"."""
    beats = []
    for line in template.strip().splitlines():
        line = line.strip()
        if line == "/":
            beats.append("/")
        elif line.startswith("|"):
            beats[-1][1].append(line[1:])
        else:
            optional = line.startswith("?")
            beats.append((optional, [line.lstrip("? ")]))
    return beats


def article(phrase):
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def character(rng, prefix, name_key, taken):
    """A child (he / she / sometimes they) or an animal (he / she), as template slots."""
    if rng.random() < 0.3:
        pronoun = rng.choice(["he", "she"])
        names = PET_NAMES.split()
        desc = f"{pick(rng, PROPS['pet'])} {pick(rng, PROPS['animal'])}"
    else:
        pronoun = rng.choices(["he", "she", "they"], [45, 45, 10])[0]
        names = NAMES[pronoun].split()
        kid = {"he": "boy", "she": "girl", "they": "child"}[pronoun]
        desc = f"{pick(rng, PROPS['kid'])} {kid}"
    name = rng.choice([n for n in names if n not in taken])
    he, him, his, was = PRONOUNS[pronoun]
    slots = {"he": he, "He": he.capitalize(), "him": him, "his": his, "His": his.capitalize()}
    slots = {prefix + k: v for k, v in slots.items()}
    return {name_key: name, prefix + "was": was, prefix + "desc": article(desc), **slots}


def make_story(rng):
    slots = character(rng, "", "A", set())
    slots.update(character(rng, "b", "B", {slots["A"]}))
    grownup = rng.choice(list(GROWNUPS))
    he, him, his, _ = PRONOUNS[GROWNUPS[grownup]]
    slots.update(P=grownup, p=grownup.lower(), phe=he, pHe=he.capitalize(), phim=him, phis=his)
    slots.update({k: pick(rng, v) for k, v in PROPS.items()})
    at_place = rng.choice(list(PLACES))
    place = at_place.split(" the ")[1]  # "at the park" -> "park"
    pet = rng.choice([n for n in PET_NAMES.split() if n not in (slots["A"], slots["B"])])
    slots.update(place=place, at_place=at_place, spot=pick(rng, PLACES[at_place]), pet=pet)
    fear = rng.choice(FEARS)
    slots.update(fear=fear[0], fear_start=fear[1], fear_help=fear[2], fear_end=fear[3])

    # Most stories have one plot; some have two episodes, which makes longer stories.
    plot = []
    for name in rng.sample(sorted(PLOTS), 2 if rng.random() < 0.2 else 1):
        plot += (["/"] if plot else []) + parse(PLOTS[name])
    friend = parse(FRIEND) if any("{B}" in " ".join(b[1]) for b in plot if b != "/") else []
    paragraphs, sentences = [], []
    keep_breaks = rng.random() < 0.5
    for beat in parse(OPENING) + friend + plot + parse(ENDING):
        if beat == "/":
            if keep_breaks:
                paragraphs.append(" ".join(sentences))
                sentences = []
            continue
        optional, alternatives = beat
        if optional and rng.random() < 0.5:
            continue
        text = pick(rng, "|".join(alternatives))
        while "{" in text:  # props like {fear_help} hold slots of their own
            text = text.format(**slots, **{k: pick(rng, v) for k, v in FREE.items()})
        sentences.append(text)
    paragraphs.append(" ".join(sentences))
    return "\n\n".join(paragraphs)


def write_split(path, rng, num_bytes, seen):
    """Write stories of 80-250 words until the file holds num_bytes; skip any repeats."""
    size = 0
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        while size < num_bytes:
            text = make_story(rng)
            if not 80 <= len(text.split()) <= 250 or text in seen:
                continue
            seen.add(text)
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            size += len(line)
    return size


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out_dir", type=Path, default=Path(__file__).parent / "datasets" / "tinytales"
    )
    parser.add_argument("--train_mb", type=float, default=4.0)
    parser.add_argument("--val_kb", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    args.out_dir.mkdir(parents=True, exist_ok=True)
    seen = set()  # validation stories never appear in train
    for split, num_bytes in [("train", args.train_mb * 1e6), ("validation", args.val_kb * 1e3)]:
        rng = random.Random(f"{split}-{args.seed}")  # str seeds hash with sha512: stable
        size = write_split(args.out_dir / f"{split}.jsonl", rng, num_bytes, seen)
        print(f"{split}: {size / 1e6:.2f} MB -> {args.out_dir / f'{split}.jsonl'}")


if __name__ == "__main__":
    main()
